"""LFM2-MoE (transformers' Lfm2MoeForCausalLM, LiquidAI/LFM2-8B-A1B): config.json read as Lfm2MoeConfig reads it,
paged-forward and engine parity with transformers (sigmoid routing chosen with expert_bias, renormalized and scaled,
the dense first layers, LFM2's convolution states across chunks, slots and preemption), both expert layouts, and two
ranks decoding as one with the experts' features split and with the experts split whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.loader import load_model
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, check_varlen_prefill_and_decode, random_tokens
from flashllm.testing.state_slots import (
    WithStateSlots,
    check_fresh_sequences_in_reused_slots,
    check_preemption_recomputes_states,
    check_states_across_prefill_chunks,
)
from flashllm.testing.tiny_moe import build_moe_model

RAW = {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "hidden_size": 64, "intermediate_size": 96,
       "moe_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 256, "layer_types": ["conv", "full_attention", "conv"], "num_experts": 8,
       "num_experts_per_tok": 2, "num_dense_layers": 1}
VOCAB = 256


@pytest.mark.parametrize("changes", [
    {},
    {"num_dense_layers": 0, "use_expert_bias": False, "norm_topk_prob": False, "routed_scaling_factor": 2.5,
     "tie_embedding": False, "conv_L_cache": 4},
    {"num_dense_layers": 3, "norm_eps": 1e-3, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
     "block_ff_dim": 999},  # block_ff_dim is LFM2's alias, which Lfm2MoeConfig does not read
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import Lfm2MoeConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), Lfm2MoeConfig(**{**RAW, **changes})
    assert ours.sparse_layers == tuple(i >= theirs.num_dense_layers for i in range(theirs.num_hidden_layers))
    assert ours.attention_layers == tuple(t == "full_attention" for t in theirs.layer_types)
    assert (ours.num_experts, ours.n_routed_experts) == (theirs.num_experts,) * 2
    assert (ours.choice_bias, ours.sigmoid_scoring, ours.group_limited, ours.n_shared_experts) == (
        theirs.use_expert_bias, True, False, 0)
    assert (ours.rms_norm_eps, ours.conv_kernel, ours.rope_theta) == (
        theirs.norm_eps, theirs.conv_L_cache, theirs.rope_parameters["rope_theta"])
    for field in ("intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
                  "routed_scaling_factor", "tie_word_embeddings", "conv_bias", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import Lfm2MoeConfig

    layers = ["conv"] * 31 + ["full_attention"]  # Lfm2MoeConfig has no default layer_types
    ours = parse_hf_config({"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "layer_types": layers})
    theirs = Lfm2MoeConfig(layer_types=layers)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "bos_token_id",
                  "eos_token_id", "tie_word_embeddings", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                  "routed_scaling_factor", "conv_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.sparse_layers == (False, False) + (True,) * 30 and ours.choice_bias == theirs.use_expert_bias
    assert (ours.rms_norm_eps, ours.rope_theta, ours.conv_kernel) == (
        theirs.norm_eps, theirs.rope_parameters["rope_theta"], theirs.conv_L_cache)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_dense_layers": -1}, "num_dense_layers=-1 must be a non-negative int"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"use_expert_bias": 1}, "use_expert_bias=1 must be true or false"),
    ({"layer_types": ["conv", "linear_attention", "conv"]}, "each one of ('conv', 'full_attention')"),
    ({"quantization_config": {"quant_method": "fp8"}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers' model, its directory) of the tiny preset (per-expert w1 / w3 / w2 tensors, a random
    expert_bias)."""
    return _hf(build_moe_model(tmp_path_factory.mktemp("lfm2_moe"), "lfm2_moe", seed=1))


def _hf(model_dir: Path):
    """(transformers' fp32 model of model_dir, running its experts one by one (the eager loop, its fastest on a CPU
    for these sizes), model_dir)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                experts_implementation="eager").eval(), model_dir


def test_paged_prefill_and_decode_match_transformers(reference, ops, model_registry, paged_driver) -> None:
    hf, model_dir = reference
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [DeepseekMoE] * 3
    assert ours.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0  # loaded, not left zero
    prompts = [random_tokens(n, VOCAB, seed=100 + n) for n in (1, 9, 40, 70)]
    check_varlen_prefill_and_decode(paged_driver(WithStateSlots(ours, 64), block_size=16, num_blocks=64, seed=3), hf,
                                    prompts)


@pytest.mark.parametrize("check", [check_states_across_prefill_chunks, check_fresh_sequences_in_reused_slots,
                                   check_preemption_recomputes_states],
                         ids=["prefill-chunks", "reused-slots", "preemption"])
def test_engine_gives_transformers_tokens_as_states_cross_chunks_slots_and_preemption(check, reference) -> None:
    hf, model_dir = reference
    check(model_dir, hf, VOCAB)


@pytest.mark.parametrize(("changes", "original_format"), [
    ({}, False),
    ({"use_expert_bias": False, "norm_topk_prob": False, "num_dense_layers": 0, "tie_word_embeddings": False}, True),
], ids=["stacked-experts", "no-bias-unnormalized-all-sparse-untied"])
def test_variants_match_transformers(changes, original_format, tmp_path: Path) -> None:
    hf, model_dir = _hf(build_moe_model(tmp_path, "lfm2_moe", seed=4, original_format=original_format, **changes))
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=32)
    check_engine_greedy_against(llm, hf, [random_tokens(n, VOCAB, seed=n) for n in (3, 40)], 8)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path: Path) -> None:
    """Heads, convolution channels and every expert's features split over the ranks; or the experts split whole."""
    model_dir = build_moe_model(tmp_path, "lfm2_moe", seed=2)
    two_ranks_decode_as_one([random_tokens(30, VOCAB, seed=3), [7, 3, 250], [5]], model_dir, **options)
