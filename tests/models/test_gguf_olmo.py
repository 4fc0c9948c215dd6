"""OLMo (first generation) GGUF files (`olmo`), written by flashllm's llama.cpp exporter from tiny transformers
OlmoForCausalLM directories (LayerNorms without parameters, q / k / v clamped at 0.5, or OLMo-1B's tied head without a
clamp), load into the directory's model: the converter's names and metadata, the directory's configuration, F32 logits
equal to the directory's and greedy tokens equal to transformers', Q8_0 as the directory rounded through Q8_0; what
llama.cpp's olmo graph would run differently (or not load) is refused, in export and in loading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    check_q8_0_file,
    edited_copy,
    exports,
    interleave_rope_rows,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
CONFIG_FIELDS = ("architecture", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                 "intermediate_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings", "clip_qkv",
                 "attention_bias", "rope_theta", "rope_scaling", "rms_norm_eps")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """OLMo-7B-0424's layout (untied, clip_qkv) and OLMo-1B's (tied head, no clamp)."""
    root = tmp_path_factory.mktemp("olmo")
    return {"clipped": build_tiny_model(root / "clipped", "olmo", seed=3),
            "tied": build_tiny_model(root / "tied", "olmo", seed=4, tie_word_embeddings=True, clip_qkv=None)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}


def test_the_file_holds_what_llama_cpp_s_converter_writes(sources, files) -> None:
    fields = _fields(files("clipped", "f32"))
    assert fields["general.architecture"] == "olmo"
    assert fields["olmo.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert fields["olmo.attention.clamp_kqv"] == pytest.approx(0.5)
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(files("clipped", "f32")).tensors}
    weights = {n: v.numpy() for n, v in load_file(str(sources["clipped"] / "model.safetensors")).items()}
    for part, heads in (("q", 4), ("k", 2)):  # reordered for adjacent-pair RoPE
        assert np.array_equal(stored[f"blk.1.attn_{part}.weight"],
                              interleave_rope_rows(weights[f"model.layers.1.self_attn.{part}_proj.weight"], heads))
    assert np.array_equal(stored["blk.1.attn_v.weight"], weights["model.layers.1.self_attn.v_proj.weight"])
    assert np.array_equal(stored["output.weight"], weights["lm_head.weight"])
    assert not any("norm" in name or name.endswith(".bias") for name in stored)  # OLMo's norms hold no tensors
    tied = gguf.GGUFReader(files("tied", "f32"))
    assert "output.weight" not in {t.name for t in tied.tensors}
    assert "olmo.attention.clamp_kqv" not in tied.fields


@pytest.mark.parametrize("kind", ["clipped", "tied"])
def test_config_is_the_directory_s(kind, sources, files) -> None:
    check_config_fields(files(kind, "f32"), sources[kind], (), approx=CONFIG_FIELDS)


@pytest.mark.parametrize("kind", ["clipped", "tied"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                               paged_driver) -> None:
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path) -> None:
    check_q8_0_file(files("clipped", "q8_0"), sources["clipped"], ops, model_registry, paged_driver, PROMPT,
                    tmp_path / "rounded", {"blk.1.attn_q.weight": "Q8_0", "blk.1.ffn_down.weight": "Q8_0"})


def test_a_clamp_of_zero_is_no_clamp(files, tmp_path) -> None:
    """llama.cpp's olmo graph clamps only where clamp_kqv is positive."""
    path = _copy(files, tmp_path / "zero.gguf", values={"olmo.attention.clamp_kqv": 0.0})
    assert load_hf_config(path).clip_qkv is None


@pytest.mark.parametrize("overrides,fragment", [
    ({"attention_bias": True}, "adds no attention biases"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "runs plain or linear rope only"),
])
def test_what_llama_cpp_would_run_differently_is_not_exported(overrides, fragment, tmp_path) -> None:
    source = build_tiny_model(tmp_path / "model", "olmo", seed=1, **overrides)
    with pytest.raises(GGUFExportError, match="OLMo with") as err:
        export_gguf(source, tmp_path / "out.gguf")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def _copy(files, path: Path, values: dict | None = None, extra=()) -> Path:
    return edited_copy(files("clipped", "f32"), path, values=values, extra=extra)


@pytest.mark.parametrize("case,fragment", [
    ("eps", "layer_norm_epsilon is 1e-06; llama.cpp's olmo graph normalizes with it"),
    ("q_bias", "holds blk.0.attn_q.bias, which llama.cpp's olmo graph never reads"),
    ("norm", "holds blk.0.attn_norm.weight, which llama.cpp's olmo graph never reads"),
    ("rope_freqs", "holds rope_freqs.weight, which llama.cpp's olmo graph never reads"),
])
def test_files_llama_cpp_runs_differently_or_rejects_are_refused_in_one_line(case, fragment, files, tmp_path) -> None:
    path = {
        "eps": lambda: _copy(files, tmp_path / "eps.gguf", values={"olmo.attention.layer_norm_epsilon": 1e-6}),
        "q_bias": lambda: _copy(files, tmp_path / "bias.gguf",
                                extra=[(f"blk.{i}.attn_q.bias", np.zeros(64, dtype=np.float32), None) for i in range(2)]),
        "norm": lambda: _copy(files, tmp_path / "norm.gguf",
                              extra=[(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32), None)
                                     for i in range(2)]),
        "rope_freqs": lambda: _copy(files, tmp_path / "freqs.gguf",
                                    extra=[("rope_freqs.weight", np.ones(8, dtype=np.float32), None)]),
    }[case]()
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
