"""Jamba: config.json read as transformers reads it, and its attention + Mamba + MoE stack giving transformers' logits
and greedy tokens through paged forwards and the whole engine (prefill chunks carrying the Mamba states, fresh
sequences in reused slots, preemption), with two tensor- (and expert-) parallel ranks decoding as one."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.jamba import JambaForCausalLM
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.hybrid_checks import check_paged_states
from flashllm.testing.parity import random_tokens
from flashllm.testing.state_slots import (
    check_bfloat16_follows_transformers,
    check_fresh_sequences_in_reused_slots,
    check_preemption_recomputes_states,
    check_states_across_prefill_chunks,
)
from flashllm.testing.tiny_models import build_tiny_model

VARIANTS = [
    {},
    {"hidden_size": 96, "num_hidden_layers": 7, "num_attention_heads": 6, "num_key_value_heads": 2,
     "attn_layer_period": 4, "attn_layer_offset": 3, "expert_layer_period": 3, "expert_layer_offset": 0,
     "num_local_experts": 6, "num_experts_per_tok": 3, "mamba_d_state": 4, "mamba_d_conv": 3, "mamba_expand": 3,
     "mamba_dt_rank": 10, "mamba_conv_bias": False, "mamba_proj_bias": True, "tie_word_embeddings": True,
     "rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
]


@pytest.mark.parametrize("changes", VARIANTS)
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import JambaConfig

    raw = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", **changes}
    ours, theirs = parse_hf_config(raw), JambaConfig(**raw)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "num_experts",
                 "num_experts_per_tok", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank", "mamba_conv_bias",
                 "mamba_proj_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.mamba_intermediate_size == theirs.mamba_expand * theirs.hidden_size
    assert ours.attention_layers == tuple(kind == "attention" for kind in theirs.layers_block_type)
    assert ours.sparse_layers == tuple(n > 1 for n in theirs.layers_num_experts)
    assert ours.head_dim == theirs.hidden_size // theirs.num_attention_heads and not ours.norm_topk_prob


@pytest.mark.parametrize("changes, fragment", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "awq"}}, "float checkpoints only"),
    ({"attn_layer_offset": 8}, "attn_layer_offset=8 must be an int in 0..7"),
    ({"num_experts_per_tok": 20}, "num_experts_per_tok=20 exceeds num_experts=16"),
    ({"mamba_dt_rank": "wide"}, "mamba_dt_rank='wide'"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({"architectures": ["JambaForCausalLM"], **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, flashllm model, transformers model) of the jamba preset."""
    from transformers import AutoModelForCausalLM

    from flashllm.backends.reference import reference_op_table
    from flashllm.models.loader import load_model
    from flashllm.testing.loading import builtin_registry

    path = build_tiny_model(tmp_path_factory.mktemp("jamba"), "jamba", seed=1, tokenizer=False)
    ours, _ = load_model(path, reference_op_table(), torch.float32, "cpu", builtin_registry(), progress=False)
    return path, ours, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_caches_follow_the_layer_kinds(tiny) -> None:
    _, ours, _ = tiny
    assert ours.kv_cache_shape() == (1, 2, 16)  # layer 1 attends: 2 KV heads of 16
    assert ours.state_cache_shapes() == [(((128, 3), torch.float32), ((128, 8), torch.float32))] * 3


def test_paged_prefill_decode_and_chunks_match_transformers(tiny, paged_driver) -> None:
    _, ours, theirs = tiny
    check_paged_states(ours, theirs, paged_driver, ours.config.vocab_size)


def test_prompts_prefilled_eight_tokens_a_step_carry_their_states_across_chunks(tiny) -> None:
    path, ours, theirs = tiny
    check_states_across_prefill_chunks(path, theirs, ours.config.vocab_size)


def test_concurrent_requests_and_one_token_prompts_in_reused_slots_match_transformers(tiny) -> None:
    path, ours, theirs = tiny
    check_fresh_sequences_in_reused_slots(path, theirs, ours.config.vocab_size)


def test_forced_preemption_recomputes_the_states_from_scratch(tiny) -> None:
    path, ours, theirs = tiny
    check_preemption_recomputes_states(path, theirs, ours.config.vocab_size)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}])
def test_two_ranks_give_one_rank_s_tokens(options, tiny) -> None:
    path, ours, _ = tiny
    two_ranks_decode_as_one([random_tokens(n, ours.config.vocab_size, seed=n) for n in (1, 9, 30)], path, **options)


def test_a_tensor_parallel_size_that_splits_no_mamba_channels_evenly_is_refused(ops) -> None:
    config = parse_hf_config({"architectures": ["JambaForCausalLM"], "hidden_size": 48, "num_attention_heads": 3,
                              "num_key_value_heads": 3, "intermediate_size": 100, "num_hidden_layers": 2,
                              "vocab_size": 256, "num_experts": 3, "mamba_expand": 1})
    with pytest.raises(ValueError, match="intermediate size 48 does not split over 5 tensor-parallel ranks"):
        JambaForCausalLM(config, ops, torch.float32, torch.device("cpu"), tp_rank=0, tp_size=5)


def test_bfloat16_engine_follows_transformers_bfloat16(tiny) -> None:
    path, ours, _ = tiny
    check_bfloat16_follows_transformers(path, ours.config.vocab_size)
