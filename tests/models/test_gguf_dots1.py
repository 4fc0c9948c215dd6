"""dots.llm1 GGUF files (`dots1`), written by flashllm's llama.cpp exporter from a tiny transformers Dots1ForCausalLM
directory (per-head q / k norms, a dense first layer, sigmoid routing with the choice bias, renormalized and scaled
weights, a shared expert), load into the directory's model: the converter's names and metadata, the directory's
configuration, F32 logits equal to the directory's and greedy tokens equal to transformers', Q8_0 as the directory
rounded through Q8_0; what llama.cpp's dots1 graph would run differently (or not load) is refused, in export and in
loading."""

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
    check_q8_0_file,
    edited_copy,
    export_of,
    patched_metadata,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# The tiny preset as llama.cpp's dots1 converter and graph take it: one expert group, full attention everywhere, as
# many key heads as query heads (its loader sizes attn_k / attn_v so); experts 64 wide (whole Q8_0 blocks)
CHANGES = {"n_group": 1, "topk_group": 1, "sliding_window": None, "layer_types": ["full_attention"] * 3,
           "num_key_value_heads": 4, "moe_intermediate_size": 64}
CONFIG_FIELDS = ("architecture", "head_dim", "qk_norm", "qkv_bias", "num_attention_heads", "num_key_value_heads",
                 "num_experts", "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size",
                 "first_k_dense_replace", "sparse_layers", "moe_intermediate_size", "norm_topk_prob",
                 "routed_scaling_factor", "sigmoid_scoring", "n_group", "topk_group", "rope_theta", "rope_scaling",
                 "intermediate_size", "vocab_size", "tie_word_embeddings", "num_hidden_layers", "sliding_windows")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dots1"), "dots1", seed=3, **CHANGES)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "dots1", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "dots1"
    fields = {k.removeprefix("dots1."): f.contents() for k, f in reader.fields.items() if k.startswith("dots1.")}
    assert {k: fields[k] for k in ("expert_count", "expert_used_count", "expert_shared_count", "expert_gating_func",
                                   "leading_dense_block_count", "expert_feed_forward_length", "expert_weights_norm",
                                   "attention.head_count_kv", "attention.key_length")} == {
        "expert_count": 8, "expert_used_count": 3, "expert_shared_count": 1, "expert_gating_func": 2,
        "leading_dense_block_count": 1, "expert_feed_forward_length": 64, "expert_weights_norm": True,
        "attention.head_count_kv": 4, "attention.key_length": 24}
    assert fields["expert_weights_scale"] == pytest.approx(1.5)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    assert np.array_equal(stored["blk.1.exp_probs_b.bias"], weights["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert np.array_equal(stored["blk.1.attn_q.weight"], weights["model.layers.1.self_attn.q_proj.weight"])  # unpermuted
    assert np.array_equal(stored["blk.2.ffn_up_shexp.weight"], weights["model.layers.2.mlp.shared_experts.up_proj.weight"])
    expected = np.stack([weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].numpy() for e in range(8)])
    assert np.array_equal(stored["blk.1.ffn_down_exps.weight"], expected)  # (E, N, K)
    assert stored["blk.1.attn_q_norm.weight"].shape == (24,) and "blk.0.ffn_gate.weight" in stored
    assert "blk.0.ffn_gate_inp.weight" not in stored and not any(name.endswith(".bias") and "exp_probs" not in name
                                                                 for name in stored)


def test_config_is_the_directory_s(source, files) -> None:
    check_config_fields(files("f32"), source, CONFIG_FIELDS)


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    types = {"blk.1.ffn_down_exps.weight": "Q8_0", "blk.1.attn_q.weight": "Q8_0", "blk.1.ffn_gate_inp.weight": "F32"}
    check_q8_0_file(files("q8_0"), source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded", types,
                    keep=("mlp.gate.weight",))


@pytest.mark.parametrize("overrides,fragment", [
    ({"n_group": 2, "topk_group": 1}, "routes without expert groups"),
    ({"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     "attends fully in every layer"),
    ({"attention_bias": True}, "adds no q / k / v biases"),
    ({"num_key_value_heads": 2}, "sizes attn_k / attn_v by the query heads"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "reads no rope factors"),
])
def test_what_llama_cpp_would_run_differently_is_not_exported(overrides, fragment, tmp_path) -> None:
    source = build_tiny_model(tmp_path / "model", "dots1", seed=1, **{**CHANGES, **overrides})
    with pytest.raises(GGUFExportError, match="dots.llm1 with") as err:
        export_gguf(source, tmp_path / "out.gguf")
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,value,fragment", [
    ("dots1.expert_gating_func", 1, "expert_gating_func is 1; dots.llm1 routes by sigmoid scores"),
    ("dots1.attention.head_count_kv", 2, "head_count_kv=2 differs from head_count=4"),
])
def test_metadata_llama_cpp_runs_differently_is_refused_in_one_line(key, value, fragment, files, tmp_path) -> None:
    assert gguf.GGUFReader(files("f32")).fields[key].types == [gguf.GGUFValueType.UINT32]
    path = patched_metadata(files("f32"), tmp_path / "bad.gguf", key, struct.pack("<I", value))
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("case,fragment", [
    ("no_gating", "expert_gating_func is 0; dots.llm1 routes by sigmoid scores"),
    ("zero_scale", "expert_weights_scale is 0.0; llama.cpp's dots1 graph multiplies"),
    ("q_bias", "holds blk.0.attn_q.bias, which llama.cpp's dots1 graph never reads"),
])
def test_files_llama_cpp_runs_differently_are_refused_in_one_line(case, fragment, files, tmp_path) -> None:
    bias = [(f"blk.{i}.attn_q.bias", np.zeros(96, dtype=np.float32), None) for i in range(3)]
    edits = {"no_gating": {"dropped": ("dots1.expert_gating_func",)},
             "zero_scale": {"values": {"dots1.expert_weights_scale": 0.0}}, "q_bias": {"extra": bias}}[case]
    path = edited_copy(files("f32"), tmp_path / "edited.gguf", **edits)
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
