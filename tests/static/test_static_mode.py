"""`--mode static` against the dynamic engine: same tokens, same output shape, same stop rules."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from flashllm.cli import USAGE_ERROR, main
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("onnx_ready")

PRESETS = ("llama3", "qwen2")
PROMPTS = ["Hello world", "The quick brown fox jumps over", [7], list(range(3, 60)), "a b c"]


@pytest.fixture(scope="module")
def dynamic(model_dirs):
    return {p: LLM(str(model_dirs[p]), dtype="float32", device="cpu", backend="reference", block_size=16,
                   num_kv_blocks=128, max_model_len=512) for p in PRESETS}


@pytest.fixture(scope="module")
def static(exported):
    from flashllm.static.runner import StaticLLM

    # max_num_seqs below the prompt count: several left-padded batches, rows leaving as they finish
    return {p: StaticLLM(exported[p], device="cpu", max_num_seqs=3, max_model_len=512) for p in PRESETS}


def _summary(outputs) -> list[tuple]:
    return [(o.prompt, o.prompt_token_ids, [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs])
            for o in outputs]


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_the_dynamic_engine(preset, static, dynamic) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours, theirs = static[preset].generate(PROMPTS, params), dynamic[preset].generate(PROMPTS, params)
    assert _summary(ours) == _summary(theirs)
    assert all(len(o.outputs[0].token_ids) == 24 and o.finished for o in ours)


@pytest.mark.parametrize("preset", PRESETS)
def test_seeded_sampling_stops_and_eos_follow_the_engine(preset, static, dynamic) -> None:
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=16, stop=["e"]),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, n=2),
              SamplingParams(temperature=0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0.7, seed=5, max_tokens=8, min_tokens=4, stop_token_ids=[9, 10]),
              SamplingParams(temperature=0, max_tokens=300)]  # may run into max_model_len / EOS
    ours, theirs = static[preset].generate(PROMPTS, params), dynamic[preset].generate(PROMPTS, params)
    assert _summary(ours) == _summary(theirs)
    for a, b in zip(ours[2].outputs[0].logprobs, theirs[2].outputs[0].logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_llm_mode_static_and_chat(exported, dynamic) -> None:
    from flashllm.static.runner import StaticLLM

    llm = LLM(str(exported["qwen2"]), mode="static", device="cpu")
    assert isinstance(llm, StaticLLM)
    messages = [{"role": "user", "content": "Name a color."}]
    params = SamplingParams(temperature=0, max_tokens=6)
    assert llm.render_chat(messages) == dynamic["qwen2"].render_chat(messages)
    assert _summary(llm.chat(messages, params)) == _summary(dynamic["qwen2"].chat(messages, params))
    with pytest.raises(ValueError, match="mode"):
        LLM(str(exported["qwen2"]), mode="graph")


def test_predict_mode_static_writes_what_dynamic_writes(exported, model_dirs, tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"src": s}) for s in ("Hello there", "What is 2+2?", "你好")) + "\n")
    common = ["predict", "--data_file", str(data), "--device", "cpu", "--max_length", "10", "--batch_size", "2",
              "--decode_strategy", "greedy_search", "--dtype", "float32"]
    assert main([*common, "--model_name_or_path", str(exported["llama3"]), "--mode", "static",
                 "--output_file", str(tmp_path / "static.jsonl")]) == 0
    assert main([*common, "--model_name_or_path", str(model_dirs["llama3"]), "--backend", "reference",
                 "--output_file", str(tmp_path / "dynamic.jsonl")]) == 0
    static_rows = (tmp_path / "static.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(static_rows) == 3
    assert static_rows == (tmp_path / "dynamic.jsonl").read_text(encoding="utf-8").splitlines()


def _broken_copy(exported: Path, tmp_path: Path) -> Path:
    target = tmp_path / "export"
    shutil.copytree(exported, target)
    return target


@pytest.mark.parametrize(("breakage", "message"), [
    ("version", "format_version 99 is not supported"),
    ("missing", "lacks model.onnx"),
    ("no_manifest", "not a static-graph export"),
    ("layers", "do not match a 3-layer decoder"),
])
def test_manifest_is_validated_on_load(breakage, message, exported, tmp_path: Path, capsys) -> None:
    from flashllm.static.manifest import MANIFEST_FILE, StaticModelError
    from flashllm.static.runner import StaticLLM

    target = _broken_copy(exported["qwen2"], tmp_path)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    if breakage == "version":
        manifest["format_version"] = 99
    elif breakage == "layers":
        manifest["num_layers"] = 3
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    if breakage == "missing":
        (target / "model.onnx").unlink()
    elif breakage == "no_manifest":
        (target / MANIFEST_FILE).unlink()
    with pytest.raises(StaticModelError, match=message):
        StaticLLM(target, device="cpu")
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"src": "hi"}) + "\n")
    argv = ["predict", "--model_name_or_path", str(target), "--mode", "static", "--data_file", str(data),
            "--output_file", str(tmp_path / "out.jsonl"), "--device", "cpu"]
    assert main(argv) == USAGE_ERROR  # a model directory the user can fix: one line, exit 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_graph_that_disagrees_with_its_manifest_is_refused(exported, tmp_path: Path) -> None:
    import onnx

    from flashllm.static.manifest import StaticModelError
    from flashllm.static.runner import StaticLLM

    target = _broken_copy(exported["qwen2"], tmp_path)
    model = onnx.load(str(target / "model.onnx"))
    model.graph.input[0].name = "tokens"
    for node in model.graph.node:
        node.input[:] = ["tokens" if name == "input_ids" else name for name in node.input]
    onnx.save(model, str(target / "model.onnx"))
    with pytest.raises(StaticModelError, match="does not match its manifest"):
        StaticLLM(target, device="cpu")


def test_static_mode_refusals(exported, monkeypatch) -> None:
    from flashllm.static.manifest import StaticModelError
    from flashllm.static.runner import StaticLLM

    with pytest.raises(StaticModelError, match="exported in float32"):
        StaticLLM(exported["qwen2"], dtype="float16")
    llm = StaticLLM(exported["qwen2"], device="cpu", max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len is 16"):
        llm.generate([list(range(16))])
    with pytest.raises(StaticModelError, match="beam search"):
        llm.beam_search([[1, 2]], 2, 4)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(StaticModelError, match=r"pip install 'flashllm\[onnx\]'"):
        StaticLLM(exported["qwen2"], device="cpu")


def test_max_model_len_ends_sequences_like_the_engine(static, dynamic) -> None:
    from flashllm.static.runner import StaticLLM

    llm = StaticLLM(static["qwen2"].model_dir, device="cpu", max_model_len=20)
    engine = LLM(str(dynamic["qwen2"].engine.parts.model_dir), dtype="float32", device="cpu", backend="reference",
                 block_size=16, num_kv_blocks=8, max_model_len=20)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompts = [list(range(1, 15)), [4, 5]]
    ours, theirs = llm.generate(prompts, params), engine.generate(prompts, params)
    assert _summary(ours) == _summary(theirs)
    assert [len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, ours, strict=True)] == [20, 20]
