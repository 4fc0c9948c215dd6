"""Cohere GGUF files, written by flashllm's llama.cpp exporter from tiny transformers directories, load as llama.cpp
runs them: `command-r` (Command R: the parallel block, adjacent-pair RoPE with Q/K rows as in the checkpoint, the
embedding as the head, logits x logit_scale; Command R+: per-head q / k norms, which llama.cpp reads at 64 layers)
and `cohere2` (Command R7B: three sliding layers of four, only those rotating, or the period the file states)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.gguf.cohere import layer_types  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    prompt_logits,
    rewritten_copy,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
QK_NORMS = ("q_norm.weight", "k_norm.weight")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cohere")
    return {"command-r": build_tiny_model(root / "r", "cohere", seed=3),
            "command-r-plus": build_tiny_model(root / "plus", "cohere", seed=4, num_hidden_layers=64, use_qk_norm=True),
            # llama.cpp's default layout (the preset's pattern 2 has no export: test_refused_exports)
            "cohere2": build_tiny_model(root / "r7b", "cohere2", seed=5, sliding_window_pattern=4)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _value(reader, key: str):
    return reader.fields[key].contents() if key in reader.fields else None


def _copy(path: Path, out: Path, extra: dict[str, np.ndarray] | None = None, without: tuple[str, ...] = (),
          values: dict | None = None, dropped: tuple[str, ...] = ()) -> Path:
    """The GGUF file `path` with tensors `extra` added, those named in `without` left out, metadata changed."""
    def tensors(stored):
        for name, tensor in stored.items():
            if name not in without:
                yield name, np.array(tensor.data), tensor.tensor_type
        for name, data in (extra or {}).items():
            yield name, data, None

    return rewritten_copy(path, out, tensors, values=values, dropped=dropped)


@pytest.mark.parametrize("kind", ["command-r", "command-r-plus"])
def test_the_file_holds_the_converter_s_names_and_metadata(kind, sources, files) -> None:
    reader = gguf.GGUFReader(files(kind, "f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(sources[kind] / "model.safetensors"))
    pairs = [("attn_q.weight", "self_attn.q_proj.weight"), ("attn_k.weight", "self_attn.k_proj.weight"),
             ("attn_norm.weight", "input_layernorm.weight"), ("ffn_gate.weight", "mlp.gate_proj.weight")]
    if kind == "command-r-plus":
        pairs += [("attn_q_norm.weight", "self_attn.q_norm.weight"), ("attn_k_norm.weight", "self_attn.k_norm.weight")]
    for part, module in pairs:  # Q/K rows as in the checkpoint: llama.cpp rotates adjacent pairs, as Cohere does
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"model.layers.1.{module}"].numpy()), part
    assert "output.weight" not in stored and "blk.0.ffn_norm.weight" not in stored
    assert ("blk.0.attn_q_norm.weight" in stored) == (kind == "command-r-plus")
    assert _value(reader, "general.architecture") == "command-r"
    assert _value(reader, "command-r.logit_scale") == pytest.approx(0.25)
    assert _value(reader, "command-r.attention.layer_norm_epsilon") == pytest.approx(1e-5)


def test_the_q8_0_file_keeps_the_q_k_norm_scales_f32(files) -> None:
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(files("command-r-plus", "q8_0")).tensors}
    assert (types["blk.0.attn_q_norm.weight"], types["blk.0.attn_k_norm.weight"]) == ("F32", "F32")
    assert types["blk.0.ffn_up.weight"] == "Q8_0"


def test_the_cohere2_file_holds_the_window_and_no_pattern(files) -> None:
    reader = gguf.GGUFReader(files("cohere2", "f32"))
    assert _value(reader, "general.architecture") == "cohere2"
    assert _value(reader, "cohere2.attention.sliding_window") == 8
    assert _value(reader, "cohere2.attention.sliding_window_pattern") is None  # as the converter: llama.cpp's 4
    assert _value(reader, "cohere2.logit_scale") == pytest.approx(0.25)


@pytest.mark.parametrize("kind", ["command-r", "command-r-plus", "cohere2"])
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == expected.architecture
    for field in ("logit_scale", "use_qk_norm", "rope_interleaved", "tie_word_embeddings", "sliding_windows",
                  "rope_layers", "head_dim", "num_key_value_heads", "vocab_size", "intermediate_size", "rope_theta"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


@pytest.mark.parametrize("kind", ["command-r", "command-r-plus", "cohere2"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


@pytest.mark.parametrize(("kind", "keep"), [("command-r", ()), ("command-r-plus", QK_NORMS), ("cohere2", ())])
def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(kind, keep, sources, files, ops, model_registry,
                                                             paged_driver, tmp_path):
    ours = load_float_model(files(kind, "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources[kind], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded", keep)


def test_a_stated_sliding_period_is_read_as_llama_cpp_reads_it(files, ops, model_registry, paged_driver,
                                                               tmp_path) -> None:
    # the preset's pattern 2 with the weights of the exported pattern-4 directory (same seed, same shapes)
    alternating = build_tiny_model(tmp_path / "alternating", "cohere2", seed=5)
    stated = _copy(files("cohere2", "f32"), tmp_path / "period2.gguf",
                   values={"cohere2.attention.sliding_window_pattern": 2})
    assert load_hf_config(stated).sliding_windows == (8, None, 8, None)
    check_f32_file(stated, alternating, ops, model_registry, paged_driver, PROMPT)


def test_llama_cpp_s_sliding_periods() -> None:
    assert layer_types(8) == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + [
        "full_attention"]
    assert layer_types(3, 0) == ["sliding_attention"] * 3
    assert layer_types(3, 1) == ["full_attention"] * 3


def test_a_zero_logit_scale_leaves_the_logits_unscaled(files, ops, model_registry, paged_driver, tmp_path) -> None:
    unscaled = _copy(files("command-r", "f32"), tmp_path / "unscaled.gguf", values={"command-r.logit_scale": 0.0})
    logits = prompt_logits(load_float_model(unscaled, ops, model_registry), paged_driver, PROMPT)
    scaled = prompt_logits(load_float_model(files("command-r", "f32"), ops, model_registry), paged_driver, PROMPT)
    torch.testing.assert_close(logits * 0.25, scaled, rtol=0, atol=1e-5)


def test_files_llama_cpp_would_not_load_or_would_run_otherwise_are_refused(files, tmp_path) -> None:
    plain, plus, r7b = files("command-r", "f32"), files("command-r-plus", "f32"), files("cohere2", "f32")
    head = np.zeros((512, 64), dtype=np.float32)
    cases = [
        (_copy(plain, tmp_path / "head.gguf", {"output.weight": head}), "output.weight, which llama.cpp's command-r"),
        (_copy(plain, tmp_path / "bias.gguf", {"blk.0.attn_q.bias": np.zeros(64, np.float32)}), "attn_q.bias"),
        (_copy(plain, tmp_path / "norms.gguf", {"blk.0.attn_q_norm.weight": np.ones((4, 16), np.float32)}),
         "attn_q_norm.weight, which llama.cpp's command-r loader never reads"),
        (_copy(plus, tmp_path / "plus.gguf", without=("blk.7.attn_k_norm.weight",)), "lacks blk.7.attn_k_norm"),
        (_copy(plain, tmp_path / "scale.gguf", dropped=("command-r.logit_scale",)), "logit_scale is None"),
        (_copy(plain, tmp_path / "eps.gguf", dropped=("command-r.attention.layer_norm_epsilon",)),
         "layer_norm_epsilon is None"),
        (_copy(r7b, tmp_path / "window.gguf", dropped=("cohere2.attention.sliding_window",)), "sliding_window is None"),
        (_copy(r7b, tmp_path / "array.gguf", values={"cohere2.attention.sliding_window_pattern": [True, False] * 2}),
         "per-layer array"),
        (_copy(r7b, tmp_path / "swa.gguf", values={"cohere2.rope.freq_base_swa": 500.0}), "freq_base_swa"),
        (_copy(r7b, tmp_path / "r7b-norms.gguf", {"blk.0.attn_k_norm.weight": np.ones((2, 16), np.float32)}),
         "llama.cpp's cohere2 loader never reads"),
    ]
    for path, fragment in cases:
        with pytest.raises(ModelLoadError, match=fragment):
            load_hf_config(path)


def test_an_array_stating_llama_cpp_s_own_layout_loads(files, tmp_path) -> None:
    same = _copy(files("cohere2", "f32"), tmp_path / "same.gguf",
                 values={"cohere2.attention.sliding_window_pattern": [True, True, True, False]})
    assert load_hf_config(same).sliding_windows == (8, 8, 8, None)


@pytest.mark.parametrize(("preset", "changes", "fragment"), [
    ("cohere", {"attention_bias": True}, "attention_bias"),
    ("cohere", {"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ("cohere", {"use_qk_norm": True}, "use_qk_norm=True and 2 layers"),
    ("cohere", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("cohere2", {}, "sliding layers \\[0, 2\\]"),
    ("cohere2", {"sliding_window_pattern": 4, "attention_bias": True}, "attention_bias"),
])
def test_what_llama_cpp_would_run_differently_has_no_export(preset, changes, fragment, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", preset, seed=1, tokenizer=False, **changes)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")
