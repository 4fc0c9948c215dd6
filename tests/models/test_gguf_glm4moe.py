"""GLM-4.5 GGUF files (`glm4moe`), written by flashllm's llama.cpp exporter from a tiny transformers Glm4MoeForCausalLM
directory (q / k / v biases, per-head q / k norms, RoPE over half of each head, a dense first layer, sigmoid routing
with the choice bias, renormalized and scaled weights, a shared expert), load into the directory's model: the
configuration the directory's own, F32 logits equal to the directory's and greedy tokens equal to transformers',
Q8_0 as the directory rounded through Q8_0, the next-token-prediction layer converted files append skipped, two
ranks (tensor and expert parallel) as one; metadata llama.cpp runs otherwise is refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    check_q8_0_file,
    export_of,
    load_float_model,
    moe_source,
    patched_metadata,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
    with_nextn_layer,
)
from flashllm.testing.tiny_moe import build_moe_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# one expert group (llama.cpp's glm4moe graph routes without groups); experts 64 wide: whole Q8_0 blocks
CHANGES = {"n_group": 1, "topk_group": 1, "moe_intermediate_size": 64}
CONFIG_FIELDS = ("architecture", "head_dim", "rotary_dim", "qk_norm", "qkv_bias", "num_attention_heads",
                 "num_key_value_heads", "num_experts", "num_experts_per_tok", "n_shared_experts",
                 "shared_expert_intermediate_size", "first_k_dense_replace", "sparse_layers", "moe_intermediate_size",
                 "norm_topk_prob", "routed_scaling_factor", "sigmoid_scoring", "n_group", "topk_group", "rope_theta",
                 "rope_scaling", "intermediate_size", "vocab_size", "tie_word_embeddings", "num_hidden_layers",
                 "max_position_embeddings")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return moe_source(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe", seed=3, **CHANGES)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    """"f32" | "q8_0" -> the exported GGUF file, written once."""
    return export_of(tmp_path_factory.mktemp("gguf"), "glm4_moe", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files):
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "glm4moe"
    fields = {k.removeprefix("glm4moe."): f.contents() for k, f in reader.fields.items() if k.startswith("glm4moe.")}
    assert {k: fields[k] for k in ("rope.dimension_count", "attention.key_length", "expert_count", "expert_used_count",
                                   "expert_shared_count", "leading_dense_block_count", "expert_gating_func",
                                   "expert_weights_norm", "block_count")} == {
        "rope.dimension_count": 12, "attention.key_length": 24, "expert_count": 8, "expert_used_count": 3,
        "expert_shared_count": 1, "leading_dense_block_count": 1, "expert_gating_func": 2,
        "expert_weights_norm": True, "block_count": 3}
    assert fields["expert_weights_scale"] == pytest.approx(1.5)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    assert np.array_equal(stored["blk.1.exp_probs_b.bias"], weights["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert np.array_equal(stored["blk.2.post_attention_norm.weight"],
                          weights["model.layers.2.post_attention_layernorm.weight"])
    assert np.array_equal(stored["blk.1.attn_q.weight"], weights["model.layers.1.self_attn.q_proj.weight"])  # unpermuted
    assert stored["blk.1.ffn_gate_exps.weight"].shape == (8, 64, 64)  # (E, N, K)
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k.bias", "blk.1.ffn_up_shexp.weight", "blk.0.ffn_gate.weight"} <= set(
        stored)
    assert not any(".ffn_norm." in name for name in stored)


def test_config_is_the_directory_s(source, files):
    check_config_fields(files("f32"), source, CONFIG_FIELDS)


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    types = {"blk.1.ffn_down_exps.weight": "Q8_0", "blk.1.attn_q.weight": "Q8_0",
             "blk.1.ffn_gate_inp.weight": "F32"}  # routers stay float, as the converter keeps them
    check_q8_0_file(files("q8_0"), source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded", types,
                    keep=("mlp.gate.weight",))


def test_the_appended_next_token_prediction_layer_is_skipped(files, ops, model_registry, paged_driver, tmp_path):
    path = with_nextn_layer(files("f32"), tmp_path / "mtp.gguf", "glm4moe", layers=3, hidden=64)
    assert "blk.3.nextn.eh_proj.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    config = load_hf_config(path)
    assert config.num_hidden_layers == 3 and config.raw["num_nextn_predict_layers"] == 1
    ours, plain = load_float_model(path, ops, model_registry), load_float_model(files("f32"), ops, model_registry)
    params = dict(ours.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(params[name], param), name
    assert torch.equal(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(plain, paged_driver, PROMPT))


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_decode_a_q8_0_file_as_one(options, files, monkeypatch, exact_w8_products):
    """Heads with their biases and norms, blocks, the shared expert and the experts split over two gloo ranks (exact
    fp32 activations: the sums differ in order only) give one rank's greedy tokens and logprobs."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("q8_0"), **options)


def test_llm_runs_a_glm4moe_gguf_file_like_its_directory(source, files):
    """The engine's own path (the cpu backend's runner, the file's vocabulary as tokenizer), not only the model."""
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["The quick brown fox", "hello"]
    results = []
    for model in (source, files("f32")):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params)])
    assert results[1] == results[0] and all(len(ids) == 8 for ids, _ in results[0])


def test_expert_groups_llama_cpp_does_not_run_are_not_exported(tmp_path):
    source = build_moe_model(tmp_path / "model", "glm4_moe", seed=1)  # the preset's 2 groups, 1 kept
    with pytest.raises(GGUFExportError, match="llama.cpp's glm4moe graph routes without groups"):
        export_gguf(source, tmp_path / "out.gguf")


@pytest.mark.parametrize("key,value,fragment", [
    ("glm4moe.expert_gating_func", 1, "GLM-4.5 routes by sigmoid scores"),
    ("glm4moe.rope.dimension_count", 7, "expected an even number of features in 2..24"),
    ("glm4moe.expert_used_count", 9, "expected a whole number in 0..8"),
])
def test_metadata_flashllm_cannot_run_as_llama_cpp_does_is_refused_in_one_line(key, value, fragment, files, tmp_path):
    assert gguf.GGUFReader(files("f32")).fields[key].types == [gguf.GGUFValueType.UINT32]
    path = patched_metadata(files("f32"), tmp_path / "bad.gguf", key, struct.pack("<I", value))
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_m_rope_sections_are_refused(files, tmp_path):
    path = rewritten_copy(files("f32"), tmp_path / "mrope.gguf",
                          lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                          values={"glm4moe.rope.dimension_sections": [4, 2, 0, 0]})
    with pytest.raises(ModelLoadError, match="GLM-4.5V's M-RoPE"):
        load_hf_config(path)
