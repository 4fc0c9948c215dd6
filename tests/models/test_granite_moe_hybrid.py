"""Granite 4.0-H (transformers' GraniteMoeHybridForCausalLM): config.json read as GraniteMoeHybridConfig reads it, and
the engine's greedy tokens and logits equal to transformers' with Mamba-2 layers' states carried across prefill chunks
and recomputed after preemption beside NoPE attention and MoE layers; RoPE and expert-free variants; two ranks split
by tensors or by experts. The tiny preset's whole-prompt paged forward and engine parity also run in
test_parity_forward.py and test_engine_parity.py; the states through chunks, reused slots and preemption in
test_mamba2_family_states.py."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM, NoRotary, SharedMLPOnly
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.hybrid_checks import reference_pair
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.state_slots import (
    recurrent_llm,
)

RAW = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 64,
       "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 256, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8, "mamba_n_groups": 2,
       "mamba_d_state": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 48}
_MIXER = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups",
          "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "use_bias": "mamba_proj_bias",
          "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}


def _compare(ours, theirs) -> None:
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id",
                 "attention_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                 "logits_scaling"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for ours_name, their_name in _MIXER.items():
        assert getattr(ours.mixer, ours_name) == getattr(theirs, their_name), ours_name
    assert ours.mixer.time_step_limit == tuple(theirs.time_step_limit)
    assert ours.mixer.norm_eps == theirs.rms_norm_eps
    assert (ours.num_experts, ours.moe_intermediate_size) == (theirs.num_local_experts, theirs.intermediate_size)
    assert ours.shared_expert_intermediate_size == theirs.shared_intermediate_size
    if theirs.num_local_experts:
        assert ours.num_experts_per_tok == theirs.num_experts_per_tok
    assert ours.rope == (theirs.position_embedding_type == "rope")
    assert ["full_attention" if a else "linear_attention" for a in ours.attention_layers] == theirs.layers_block_type


@pytest.mark.parametrize("changes", [
    {}, {"mamba_proj_bias": True, "mamba_conv_bias": False, "rms_norm_eps": 1e-3, "time_step_limit": [0.01, 0.5],
         "tie_word_embeddings": True, "position_embedding_type": "rope", "embedding_multiplier": 12.0,
         "residual_multiplier": 0.22, "attention_multiplier": 0.0625, "logits_scaling": 8.0},
    {"num_local_experts": 0, "layer_types": ["full_attention", "linear_attention", "linear_attention"],
     "mamba_expand": 4, "mamba_n_heads": 16, "mamba_n_groups": 1, "attention_bias": True},
    {"layer_types": None, "position_embedding_type": "nope"},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import GraniteMoeHybridConfig

    _compare(parse_hf_config({**RAW, **changes}), GraniteMoeHybridConfig(**{**RAW, **changes}))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import GraniteMoeHybridConfig

    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid"}
    _compare(parse_hf_config(raw), GraniteMoeHybridConfig())


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mamba_n_groups": 3}, "mamba_n_groups=3 does not divide mamba_n_heads=8"),
    ({"layer_types": ["mamba", "attention"]}, "must list num_hidden_layers=3 entries"),
    ({"layer_types": ["mamba", "moe", "mamba"]}, "must list num_hidden_layers=3 entries"),
    ({"shared_intermediate_size": 0}, "every GraniteMoeHybrid layer has a shared MLP"),
    ({"quantization_config": {"quant_method": "fp8"}}, "pre-quantized GraniteMoeSharedForCausalLM"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_layers_follow_layer_types_and_position_embedding_type(ops) -> None:
    model = GraniteMoeHybridForCausalLM(parse_hf_config(RAW), ops, torch.float32, torch.device("cpu"))
    assert [layer.is_attention for layer in model.model.layers] == [False, True, False]
    assert type(model.model.layers[1].self_attn.rotary_emb) is NoRotary
    assert model.model.layers[1].self_attn.attn.scale == 1.0  # attention_multiplier's default, not head_dim ** -0.5
    assert model.kv_cache_shape() == (1, 2, 16)
    dense = parse_hf_config({**RAW, "num_local_experts": 0, "position_embedding_type": "rope"})
    model = GraniteMoeHybridForCausalLM(dense, ops, torch.float32, torch.device("cpu"))
    assert type(model.model.layers[0].mlp) is SharedMLPOnly
    assert type(model.model.layers[1].self_attn.rotary_emb) is RotaryEmbedding
    with pytest.raises(ModelLoadError, match="has no experts") as info:
        GraniteMoeHybridForCausalLM.with_expert_parallel(dense)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return reference_pair(tmp_path_factory.mktemp("granitemoehybrid"), "granitemoehybrid", seed=4)


@pytest.mark.parametrize("changes", [
    {"position_embedding_type": "rope", "tie_word_embeddings": True, "attention_bias": True},
    {"num_local_experts": 0, "layer_types": ["attention", "mamba", "mamba"], "mamba_proj_bias": True},
], ids=["rope-tied-biased", "no-experts"])
def test_variants_match_transformers(changes, tmp_path) -> None:
    model_dir, hf = reference_pair(tmp_path, "granitemoehybrid", 7, **changes)
    llm = recurrent_llm(model_dir, max_num_batched_tokens=16, enable_chunked_prefill=True)
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (1, 23, 40)], 5)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(tiny, options) -> None:
    """Tensor parallel: each rank 4 Mamba heads and 1 group, 2 query heads and 1 KV head, half of every expert and of
    the shared MLP; expert parallel: 2 whole experts a rank (the rest split as before)."""
    two_ranks_decode_as_one([random_tokens(30, 256, seed=3), [7], random_tokens(12, 256, seed=4)], tiny[0], **options)
