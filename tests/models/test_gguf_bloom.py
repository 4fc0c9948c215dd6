"""BLOOM GGUF files (`bloom`: BLOOM, BLOOMZ), written by flashllm's llama.cpp exporter from tiny transformers
BloomForCausalLM directories, load as llama.cpp runs them: the embedding's LayerNorm (`token_embd_norm`), the fused
attn_qkv weight and bias in the converter's [all q | all k | all v] row order, ALiBi with BLOOM's slopes (llama.cpp's
maximum bias 8) over 6 heads, biased LayerNorms and projections, the tanh GELU, the head tied or (as the converter
writes a tied checkpoint) a copy of the embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

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
HEADS, HEAD_DIM = 6, 16  # the tiny preset's


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tied preset, and an untied one with an eps of its own."""
    root = tmp_path_factory.mktemp("bloom")
    return {"tied": build_tiny_model(root / "tied", "bloom", seed=3),
            "untied": build_tiny_model(root / "untied", "bloom", seed=4, tie_word_embeddings=False,
                                       layer_norm_epsilon=1e-3)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _metadata(reader, key: str):
    field = reader.fields[key]
    return field.parts[field.data[0]][0]


def test_the_file_holds_the_converter_s_names_rows_and_metadata(sources, files) -> None:
    reader = gguf.GGUFReader(files("untied", "f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = {name.removeprefix("transformer."): value.numpy()
               for name, value in load_file(str(sources["untied"] / "model.safetensors")).items()}
    for kind in ("weight", "bias"):  # checkpoint rows per head: q, k, v; the file's: every q, every k, every v
        fused = weights[f"h.1.self_attention.query_key_value.{kind}"]
        expected = [fused[h * 3 * HEAD_DIM + part * HEAD_DIM:h * 3 * HEAD_DIM + (part + 1) * HEAD_DIM]
                    for part in range(3) for h in range(HEADS)]
        assert np.array_equal(stored[f"blk.1.attn_qkv.{kind}"], np.concatenate(expected)), kind
    for part, name in (("attn_output.bias", "self_attention.dense.bias"), ("ffn_up.weight", "mlp.dense_h_to_4h.weight"),
                       ("ffn_down.bias", "mlp.dense_4h_to_h.bias"), ("attn_norm.bias", "input_layernorm.bias"),
                       ("ffn_norm.weight", "post_attention_layernorm.weight")):
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"h.1.{name}"]), part
    for part, name in (("token_embd.weight", "word_embeddings.weight"), ("output.weight", "lm_head.weight"),
                       ("token_embd_norm.weight", "word_embeddings_layernorm.weight"),
                       ("token_embd_norm.bias", "word_embeddings_layernorm.bias"), ("output_norm.bias", "ln_f.bias")):
        assert np.array_equal(stored[part], weights.get(name, weights.get(f"transformer.{name}"))), part
    assert float(_metadata(reader, "bloom.attention.layer_norm_epsilon")) == pytest.approx(1e-3)
    assert int(_metadata(reader, "bloom.attention.head_count_kv")) == HEADS
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(files("tied", "f32")).tensors}


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == "BloomForCausalLM"
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "tie_word_embeddings", "attention_bias", "mlp_bias", "vocab_size", "intermediate_size", "head_dim",
                  "hidden_act", "alibi"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("tied", "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources["tied"], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def _with_output_copy(tensors):
    """The tied file as the converter writes it: `output` a copy of the embedding."""
    for name, tensor in tensors.items():
        yield name, np.array(tensor.data), tensor.tensor_type
    yield "output.weight", np.array(tensors["token_embd.weight"].data), None


def test_the_converter_s_copied_head_runs_as_the_tied_one(files, ops, model_registry, paged_driver, tmp_path):
    copied = rewritten_copy(files("tied", "f32"), tmp_path / "copied.gguf", _with_output_copy)
    assert not load_hf_config(copied).tie_word_embeddings
    ours = prompt_logits(load_float_model(copied, ops, model_registry), paged_driver, PROMPT)
    tied = prompt_logits(load_float_model(files("tied", "f32"), ops, model_registry), paged_driver, PROMPT)
    torch.testing.assert_close(ours, tied, rtol=0, atol=0)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(files, monkeypatch, exact_w8_products) -> None:
    """Each rank takes its heads' rows out of every part of the fused attn_qkv Q8_0 blocks and its heads' ALiBi
    slopes (fp32 activations)."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("tied", "q8_0"))


def _without(*dropped: str):
    return lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items() if n not in dropped)


@pytest.mark.parametrize(("tensors", "values", "dropped", "fragment"), [
    (_without("token_embd_norm.bias"), None, (), "lacks token_embd_norm.bias"),
    (_without("blk.0.attn_qkv.bias"), None, (), "lacks blk.0.attn_qkv.bias"),
    (_without(), None, ("bloom.attention.layer_norm_epsilon",), "layer_norm_epsilon is None"),
    (_without(), {"bloom.attention.head_count_kv": 2}, (), "no grouped-query attention"),
    (_without(), {"bloom.feed_forward_length": 192}, (), "4 x hidden wide"),
])
def test_a_file_llama_cpp_would_run_otherwise_is_refused(tensors, values, dropped, fragment, files, tmp_path):
    broken = rewritten_copy(files("tied", "f32"), tmp_path / "broken.gguf", tensors, values=values, dropped=dropped)
    with pytest.raises(ModelLoadError, match=fragment):
        load_hf_config(broken)
