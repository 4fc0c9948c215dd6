"""The exported ONNX graph: transformers' logits with and without a past cache, padding, the file itself."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flashllm.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("onnx_ready")

PRESETS = ("llama3", "qwen2")  # as exported by conftest
ATOL = 1e-4  # fp32 logits of order 1 through a 2-layer model


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    return {p: AutoModelForCausalLM.from_pretrained(model_dirs[p], dtype=torch.float32).eval() for p in PRESETS}


@pytest.fixture(scope="module")
def sessions(exported):
    import onnxruntime as ort

    return {p: ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
            for p, d in exported.items()}


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _run(session, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, past: list[np.ndarray]):
    names = [i.name for i in session.get_inputs()]
    logits, *present = session.run(None, dict(zip(names, [ids, positions, mask, *past], strict=True)))
    return logits, present


def _empty_past(session, batch: int) -> list[np.ndarray]:
    shapes = [i.shape for i in session.get_inputs()[3:]]
    return [np.zeros((batch, s[1], 0, s[3]), dtype=np.float32) for s in shapes]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("length", [1, 7, 33])
def test_prefill_logits_match_transformers(preset, length, sessions, hf_models) -> None:
    ids = torch.randint(0, hf_models[preset].config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    session = sessions[preset]
    logits, present = _run(session, np.array([ids]), np.arange(length)[None], np.ones((1, length), np.int64),
                           _empty_past(session, 1))
    np.testing.assert_allclose(logits[0], _hf_logits(hf_models[preset], ids), atol=ATOL, rtol=0)
    assert all(kv.shape[2] == length for kv in present)


@pytest.mark.parametrize("preset", PRESETS)
def test_past_cache_continues_like_one_long_prompt(preset, sessions, hf_models) -> None:
    """33 tokens, then 7 more with the cache, then 1 by 1: every logits row equals a full forward's."""
    model, session = hf_models[preset], sessions[preset]
    ids = torch.randint(0, model.config.vocab_size, (43,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _hf_logits(model, ids)
    past, done, rows = _empty_past(session, 1), 0, []
    for chunk in (33, 7, 1, 1, 1):
        new = np.array([ids[done:done + chunk]])
        positions = np.arange(done, done + chunk)[None]
        logits, past = _run(session, new, positions, np.ones((1, done + chunk), np.int64), past)
        rows.append(logits[0])
        done += chunk
    np.testing.assert_allclose(np.concatenate(rows), expected, atol=ATOL, rtol=0)


def test_left_padded_batch_equals_each_prompt_alone(sessions, hf_models) -> None:
    model, session = hf_models["qwen2"], sessions["qwen2"]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 9, 6)]
    width = 9
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    positions = np.maximum(mask.cumsum(1) - 1, 0)
    logits, past = _run(session, ids, positions, mask, _empty_past(session, 3))
    nxt = logits[:, -1].argmax(-1)
    step, _ = _run(session, nxt[:, None], np.array([[len(p)] for p in prompts]),
                   np.concatenate([mask, np.ones((3, 1), np.int64)], 1), past)
    for i, p in enumerate(prompts):
        full = _hf_logits(model, [*p, int(nxt[i])])
        np.testing.assert_allclose(logits[i, width - len(p):], full[:-1], atol=ATOL, rtol=0)
        np.testing.assert_allclose(step[i, 0], full[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_graph_is_valid_standard_onnx(preset, exported) -> None:
    import onnx

    from flashllm.static.export import graph_domains

    path = exported[preset] / "model.onnx"
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert graph_domains(path) <= {"", "ai.onnx"}, "the graph uses custom (non-standard) operators"


@pytest.mark.parametrize("preset", PRESETS)
def test_manifest_and_side_files(preset, exported, model_dirs) -> None:
    from flashllm.static.manifest import read_manifest

    out, src = exported[preset], model_dirs[preset]
    manifest = read_manifest(out)
    config = json.loads((src / "config.json").read_text())
    assert manifest.architecture == config["architectures"][0]
    assert manifest.num_layers == config["num_hidden_layers"] and manifest.vocab_size == config["vocab_size"]
    assert (manifest.dtype, manifest.opset) == ("float32", 18)
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update(name.encode() + b"\0" + (src / name).read_bytes())
    assert manifest.weights_sha256 == digest.hexdigest()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


def test_export_refuses_a_non_empty_directory_and_bad_dtype(model_dirs, tmp_path: Path) -> None:
    from flashllm.static.export import export_onnx
    from flashllm.static.manifest import StaticModelError

    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(StaticModelError, match="not empty"):
        export_onnx(model_dirs["qwen2"], tmp_path)
    with pytest.raises(StaticModelError, match="bfloat16"):
        export_onnx(model_dirs["qwen2"], tmp_path / "new", dtype="bfloat16")
    assert (tmp_path / "keep.txt").read_text() == "user data"


def test_float16_export_with_external_weights_tracks_float32(model_dirs, sessions, tmp_path: Path,
                                                             monkeypatch) -> None:
    """float16 graph, with its weights forced into model.onnx.data (what a model past 1 GiB gets)."""
    import onnxruntime as ort

    from flashllm.static import export
    from flashllm.static.runner import StaticLLM

    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "fp16"
    manifest = export.export_onnx(model_dirs["qwen2"], out, dtype="float16")
    assert manifest.dtype == "float16" and manifest.files == ["model.onnx", "model.onnx.data"]
    assert (out / "model.onnx").stat().st_size < (out / "model.onnx.data").stat().st_size
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[3].type == "tensor(float16)"
    ids = np.array([list(range(5, 25))])
    args = (ids, np.arange(20)[None], np.ones((1, 20), np.int64))
    half, present = _run(session, *args, [p.astype(np.float16) for p in _empty_past(session, 1)])
    full, _ = _run(sessions["qwen2"], *args, _empty_past(sessions["qwen2"], 1))
    assert half.dtype == np.float32 and present[0].dtype == np.float16
    np.testing.assert_allclose(half, full, atol=3e-2, rtol=0)
    outputs = StaticLLM(out, device="cpu").generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert len(outputs[0].outputs[0].token_ids) == 3
