"""StableLM GGUF files (`stablelm`: StableLM 2 1.6B / 12B, StableLM-3B-4E1T), written by flashllm's llama.cpp exporter
from tiny transformers StableLmForCausalLM directories, load as llama.cpp runs them: biased LayerNorms, q / k / v
biases where the file has them, RoPE over `rope.dimension_count` features of each head, and StableLM 2 12B's per-head
q / k norms (stacked by the converter into one (heads, head_dim) tensor) and parallel residual (a layer without
ffn_norm, whatever `use_parallel_residual` says)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """StableLM 2 1.6B's layout (sequential, q / k / v biases) and 12B's (parallel residual, per-head q / k norms, no
    q / k / v biases), the latter over half of each head."""
    root = tmp_path_factory.mktemp("stablelm")
    return {"sequential": build_tiny_model(root / "sequential", "stablelm", seed=3),
            "twelve_b": build_tiny_model(root / "twelve_b", "stablelm", seed=4, use_parallel_residual=True,
                                         qk_layernorm=True, use_qkv_bias=False, partial_rotary_factor=0.5,
                                         layer_norm_eps=1e-3)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _metadata(reader, key: str):
    field = reader.fields[key]
    return field.parts[field.data[0]][0]


def test_the_file_holds_the_converter_s_names_and_metadata(sources, files) -> None:
    reader = gguf.GGUFReader(files("twelve_b", "q8_0"))
    stored = {t.name: t for t in reader.tensors}
    weights = {name: value.numpy() for name, value in load_file(str(sources["twelve_b"] / "model.safetensors")).items()}
    for kind, heads in (("q", 4), ("k", 2)):  # one LayerNorm scale row per head, head order, kept F32
        stacked = stored[f"blk.1.attn_{kind}_norm.weight"]
        rows = [weights[f"model.layers.1.self_attn.{kind}_layernorm.norms.{h}.weight"] for h in range(heads)]
        assert np.array_equal(np.array(stacked.data), np.stack(rows)), kind
        assert stacked.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.array(stored["output_norm.bias"].data), weights["model.norm.bias"])
    assert not any(".ffn_norm." in name or ".attn_q.bias" in name for name in stored)  # parallel, no biases
    assert float(_metadata(reader, "stablelm.attention.layer_norm_epsilon")) == pytest.approx(1e-3)
    assert int(_metadata(reader, "stablelm.rope.dimension_count")) == 8
    assert bool(_metadata(reader, "stablelm.use_parallel_residual"))
    sequential = gguf.GGUFReader(files("sequential", "f32"))
    names = {t.name for t in sequential.tensors}
    assert {"blk.0.ffn_norm.bias", "blk.0.attn_q.bias", "blk.0.attn_v.bias"} <= names
    assert "blk.0.attn_q_norm.weight" not in names
    assert not bool(_metadata(sequential, "stablelm.use_parallel_residual"))
    assert int(_metadata(sequential, "stablelm.rope.dimension_count")) == 4


@pytest.mark.parametrize("kind", ["sequential", "twelve_b"])
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == "StableLmForCausalLM"
    for field in ("rotary_dim", "rope_theta", "num_key_value_heads", "tie_word_embeddings", "attention_bias",
                  "hidden_act", "vocab_size", "intermediate_size", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(expected, field), field
    for flag in ("use_parallel_residual", "qk_layernorm"):
        assert ours.raw[flag] == expected.raw[flag], flag
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


@pytest.mark.parametrize("kind", ["sequential", "twelve_b"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("twelve_b", "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources["twelve_b"], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(files, monkeypatch, exact_w8_products) -> None:
    """Each rank takes its query / key heads' norm rows beside their Q8_0 projection rows (fp32 activations)."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("twelve_b", "q8_0"))


def _copied(tensors):
    return ((name, np.array(tensor.data), tensor.tensor_type) for name, tensor in tensors.items())


def test_the_residual_follows_ffn_norm_not_the_metadata(files, ops, model_registry, paged_driver, tmp_path):
    """The converter writes use_parallel_residual true where config.json has no such field (StableLM-3B-4E1T); the
    graph runs the sequential block wherever the layer has an ffn_norm."""
    said_parallel = rewritten_copy(files("sequential", "f32"), tmp_path / "said.gguf", _copied,
                                   values={"stablelm.use_parallel_residual": True})
    assert load_hf_config(said_parallel).raw["use_parallel_residual"] is False
    ours = load_float_model(said_parallel, ops, model_registry)
    plain = load_float_model(files("sequential", "f32"), ops, model_registry)
    assert torch.equal(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(plain, paged_driver, PROMPT))


def _fused_qkv(tensors):
    """Each layer's attn_q, attn_k and attn_v (weights and biases) stacked along the rows into attn_qkv, q first, as
    llama.cpp's stablelm loader also reads them."""
    for name, tensor in tensors.items():
        if ".attn_k." in name or ".attn_v." in name:
            continue
        if ".attn_q." in name:
            parts = [np.array(tensors[name.replace("attn_q", p)].data) for p in ("attn_q", "attn_k", "attn_v")]
            yield name.replace("attn_q", "attn_qkv"), np.ascontiguousarray(np.concatenate(parts)), tensor.tensor_type
        else:
            yield name, np.array(tensor.data), tensor.tensor_type


def test_a_fused_attn_qkv_file_loads_the_same_model(files, ops, model_registry, paged_driver, tmp_path) -> None:
    fused = rewritten_copy(files("sequential", "f32"), tmp_path / "fused.gguf", _fused_qkv)
    assert "blk.0.attn_qkv.bias" in {t.name for t in gguf.GGUFReader(fused).tensors}
    ours, separate = load_float_model(fused, ops, model_registry), load_float_model(files("sequential", "f32"), ops,
                                                                                     model_registry)
    assert torch.equal(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(separate, paged_driver, PROMPT))


def _without(*dropped: str):
    return lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items() if n not in dropped)


def _with_output_bias(tensors):
    yield from _copied(tensors)
    yield "blk.0.attn_output.bias", np.zeros(64, dtype=np.float32), None


@pytest.mark.parametrize(("kind", "tensors", "dropped", "fragment"), [
    ("sequential", _without("output.weight"), (), "lacks output.weight"),
    ("sequential", _without("blk.0.attn_norm.bias"), (), "lacks blk.0.attn_norm.bias"),
    ("sequential", _with_output_bias, (), "holds blk.0.attn_output.bias, which llama.cpp"),
    ("sequential", _without("blk.1.ffn_norm.weight", "blk.1.ffn_norm.bias"), (), "layer 1's"),
    ("sequential", _without("blk.0.ffn_norm.bias"), (), "layer 0 holds only some of ffn_norm.weight"),
    ("sequential", _without("blk.1.attn_v.bias"), (), "layer 1 holds only some of attn_q.bias"),
    ("twelve_b", _without("blk.0.attn_k_norm.weight"), (), "only some of attn_q_norm.weight"),
    ("twelve_b", _copied, ("stablelm.attention.layer_norm_epsilon",), "layer_norm_epsilon is None"),
])
def test_a_file_llama_cpp_would_run_otherwise_is_refused(kind, tensors, dropped, fragment, files, tmp_path):
    broken = rewritten_copy(files(kind, "f32"), tmp_path / "broken.gguf", tensors, dropped=dropped)
    with pytest.raises(ModelLoadError, match=fragment):
        load_hf_config(broken)


def test_a_tied_head_has_no_export(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "stablelm", seed=1, tie_word_embeddings=True)
    with pytest.raises(GGUFExportError, match="tie_word_embeddings"):
        export_gguf(model_dir, tmp_path / "model.gguf")
