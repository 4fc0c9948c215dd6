"""ERNIE 4.5 GGUF files (`ernie4_5`, `ernie4_5-moe`), written by flashllm's llama.cpp exporter from tiny transformers
Ernie4_5ForCausalLM / Ernie4_5_MoeForCausalLM directories (adjacent-pair RoPE; softmax routing with the choice bias,
a shared expert, MoE layers 1 and 3), load into the directory's model: the configuration the directory's own, F32
logits equal to the directory's and greedy tokens equal to transformers', Q8_0 as the directory rounded through
Q8_0, two ranks as one; what llama.cpp's graphs run otherwise is refused in one line."""

from __future__ import annotations

import struct
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
    check_q8_0_logits,
    exports,
    load_float_model,
    moe_source,
    patched_metadata,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402
from flashllm.testing.tiny_moe import build_moe_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
ARCHS = {"dense": "ernie4_5", "moe": "ernie4_5-moe"}
CONFIG_FIELDS = ("architecture", "head_dim", "rotary_dim", "rope_interleaved", "attention_bias", "mlp_bias",
                 "num_attention_heads", "num_key_value_heads", "rope_theta", "rope_scaling", "intermediate_size",
                 "vocab_size", "tie_word_embeddings", "num_hidden_layers", "max_position_embeddings")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "sparse_layers",
              "norm_topk_prob", "sigmoid_scoring", "choice_bias")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    dense = build_tiny_model(tmp_path_factory.mktemp("dense"), "ernie4_5", seed=3, use_bias=False)
    moe = moe_source(tmp_path_factory.mktemp("moe"), "ernie4_5_moe", seed=3, moe_intermediate_size=64)
    return {"dense": dense, "moe": moe}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    """(kind, "f32" | "q8_0") -> the exported GGUF file, written once."""
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _fields(path: Path, arch: str) -> dict:
    reader = gguf.GGUFReader(path)
    return {k.removeprefix(f"{arch}."): f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}


def test_the_files_hold_what_llama_cpp_s_converter_writes(sources, files):
    assert gguf.GGUFReader(files("dense", "f32")).fields["general.architecture"].contents() == "ernie4_5"
    fields = _fields(files("moe", "f32"), "ernie4_5-moe")
    assert {k: fields[k] for k in ("expert_count", "expert_used_count", "interleave_moe_layer_step",
                                   "leading_dense_block_count", "expert_feed_forward_length", "expert_shared_count",
                                   "rope.dimension_count")} == {
        "expert_count": 8, "expert_used_count": 3, "interleave_moe_layer_step": 2, "leading_dense_block_count": 1,
        "expert_feed_forward_length": 64, "expert_shared_count": 1, "rope.dimension_count": 16}
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(files("moe", "f32")).tensors}
    weights = load_file(str(sources["moe"] / "model.safetensors"))
    bias = weights["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    assert np.array_equal(stored["blk.1.exp_probs_b.bias"].reshape(-1), bias.reshape(-1).numpy())
    assert np.array_equal(stored["blk.1.attn_q.weight"], weights["model.layers.1.self_attn.q_proj.weight"])
    assert stored["blk.3.ffn_gate_exps.weight"].shape == (8, 64, 64) and "blk.2.ffn_gate.weight" in stored


@pytest.mark.parametrize("kind", list(ARCHS))
def test_config_is_the_directory_s(kind, sources, files):
    check_config_fields(files(kind, "f32"), sources[kind], CONFIG_FIELDS + (MOE_FIELDS if kind == "moe" else ()))


@pytest.mark.parametrize("kind", list(ARCHS))
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


@pytest.mark.parametrize("kind", list(ARCHS))
def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(kind, sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files(kind, "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources[kind], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded",
                      keep=("mlp.gate.weight", "e_score_correction_bias"))


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_decode_a_q8_0_moe_file_as_one(options, files, monkeypatch, exact_w8_products):
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("moe", "q8_0"), **options)


def test_biases_and_an_early_moe_end_llama_cpp_runs_otherwise_are_not_exported(tmp_path):
    biased = build_tiny_model(tmp_path / "biased", "ernie4_5", seed=1, tokenizer=False)  # the preset's use_bias
    with pytest.raises(GGUFExportError, match="use_bias=true has no GGUF export here"):
        export_gguf(biased, tmp_path / "biased.gguf")
    early = build_moe_model(tmp_path / "early", "ernie4_5_moe", seed=1, moe_layer_end_index=2)
    with pytest.raises(GGUFExportError, match="moe_layer_end_index=2 have no GGUF export here"):
        export_gguf(early, tmp_path / "early.gguf")


def test_metadata_and_tensors_llama_cpp_runs_otherwise_are_refused_in_one_line(files, tmp_path):
    path = patched_metadata(files("dense", "f32"), tmp_path / "rope.gguf", "ernie4_5.rope.dimension_count",
                            struct.pack("<I", 8))
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert "rope over 8 of 16 head features (partial rotary) is not supported" in str(err.value)

    def with_output_bias(tensors):
        for name, tensor in tensors.items():
            yield name, np.array(tensor.data), tensor.tensor_type
        yield "blk.0.attn_output.bias", np.zeros(64, dtype=np.float32), None

    biased = rewritten_copy(files("dense", "f32"), tmp_path / "bias.gguf", with_output_bias)
    with pytest.raises(ModelLoadError, match=r"holds blk\.0\.attn_output\.bias: llama\.cpp's ernie4_5 graph adds"):
        load_hf_config(biased)
