"""Hunyuan MoE GGUF files (`hunyuan-moe`), written by flashllm's llama.cpp exporter from a tiny transformers
HunYuanMoEV1ForCausalLM directory (biased attention, per-head q / k norms after RoPE, the NTK alpha folded into the
RoPE base, top-2 of 4 softmax experts renormalized beside an ungated shared MLP), load into the directory's model: the
converter's names and metadata, the directory's configuration, F32 logits equal to the directory's and greedy tokens
equal to transformers', Q8_0 as the directory rounded through Q8_0; what llama.cpp's hunyuan-moe graph would run
differently is refused, in export and in loading."""

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
    export_of,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
CHANGES = {"intermediate_size": 64}  # experts and shared MLP in whole Q8_0 blocks
CONFIG_FIELDS = ("architecture", "head_dim", "qk_norm", "qkv_bias", "num_attention_heads", "num_key_value_heads",
                 "num_experts", "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size",
                 "sparse_layers", "moe_intermediate_size", "norm_topk_prob", "routed_scaling_factor",
                 "sigmoid_scoring", "rope_scaling", "intermediate_size", "vocab_size", "tie_word_embeddings",
                 "num_hidden_layers")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hunyuan_moe"), "hunyuan_moe", seed=3, **CHANGES)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "hunyuan_moe", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "hunyuan-moe"
    prefix = "hunyuan-moe."
    fields = {k.removeprefix(prefix): f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}
    assert {k: fields[k] for k in ("expert_count", "expert_used_count", "expert_feed_forward_length",
                                   "expert_shared_feed_forward_length", "expert_shared_count",
                                   "feed_forward_length")} == {
        "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 64,
        "expert_shared_feed_forward_length": 64, "expert_shared_count": 1, "feed_forward_length": 64}
    assert fields["rope.freq_base"] == pytest.approx(10000.0 * 50.0 ** (16 / 14), rel=1e-6)  # the alpha folded in
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    assert np.array_equal(stored["blk.1.ffn_gate_inp.weight"], weights["model.layers.1.mlp.gate.wg.weight"])
    assert np.array_equal(stored["blk.1.ffn_down_shexp.weight"], weights["model.layers.1.mlp.shared_mlp.down_proj.weight"])
    assert np.array_equal(stored["blk.1.attn_q_norm.weight"], weights["model.layers.1.self_attn.query_layernorm.weight"])
    assert np.array_equal(stored["blk.1.attn_q.weight"], weights["model.layers.1.self_attn.q_proj.weight"])  # unpermuted
    expected = np.stack([weights[f"model.layers.1.mlp.experts.{e}.up_proj.weight"].numpy() for e in range(4)])
    assert np.array_equal(stored["blk.1.ffn_up_exps.weight"], expected)  # (E, N, K)
    assert {"blk.0.attn_q.bias", "blk.0.attn_output.bias", "output.weight"} <= set(stored)


def test_config_is_the_directory_s(source, files) -> None:
    # rel=1e-6 is also pytest.approx's default, which rms_norm_eps was held to
    check_config_fields(files("f32"), source, CONFIG_FIELDS, approx=("rope_theta", "rms_norm_eps"), rel=1e-6)


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    types = {"blk.1.ffn_down_exps.weight": "Q8_0", "blk.1.ffn_up_shexp.weight": "Q8_0",
             "blk.1.ffn_gate_inp.weight": "F32"}
    check_q8_0_file(files("q8_0"), source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded", types,
                    keep=("mlp.gate.wg.weight",))


@pytest.mark.parametrize("overrides,fragment", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "reads no rope scaling"),
    ({"head_dim": 8}, "folds the NTK alpha over hidden_size / num_attention_heads = 16 features"),
])
def test_what_llama_cpp_would_run_differently_is_not_exported(overrides, fragment, tmp_path) -> None:
    source = build_tiny_model(tmp_path / "model", "hunyuan_moe", seed=1, **{**CHANGES, **overrides})
    with pytest.raises(GGUFExportError, match="Hunyuan MoE with") as err:
        export_gguf(source, tmp_path / "out.gguf")
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("case,fragment", [
    ("some_biases", "holds biases for attn_q, attn_k, attn_v only; flashllm's Hunyuan MoE biases"),
    ("shared_width", "expert_shared_feed_forward_length=32 differs from feed_forward_length=64"),
    ("scaling", "rope scaling 'linear'; llama.cpp's hunyuan-moe graph takes its NTK alpha folded"),
])
def test_files_llama_cpp_runs_differently_are_refused_in_one_line(case, fragment, files, tmp_path) -> None:
    edits = {"some_biases": {"left_out": ("attn_output.bias",)},
             "shared_width": {"values": {"hunyuan-moe.expert_shared_feed_forward_length": 32}},
             "scaling": {"values": {"hunyuan-moe.rope.scaling.type": "linear", "hunyuan-moe.rope.scaling.factor": 2.0}},
             }[case]
    path = edited_copy(files("f32"), tmp_path / "edited.gguf", **edits)
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
