"""Bamba (transformers' BambaForCausalLM): config.json read as BambaConfig reads it, and the engine's greedy tokens and
logits equal to transformers' with Mamba-2 layers' states carried across prefill chunks and recomputed after
preemption beside paged attention layers, and on two tensor-parallel ranks. The tiny preset's whole-prompt paged
forward and engine parity also run in test_parity_forward.py and test_engine_parity.py; the states through chunks,
reused slots and preemption in test_mamba2_family_states.py."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.bamba import BambaForCausalLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.hybrid_checks import reference_pair
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.state_slots import (
    recurrent_llm,
)

RAW = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16}
_MIXER = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups",
          "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "use_bias": "mamba_proj_bias",
          "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}


def _compare(ours, theirs) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                 "bos_token_id", "eos_token_id", "attention_bias", "mlp_bias", "hidden_act"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for ours_name, their_name in _MIXER.items():
        assert getattr(ours.mixer, ours_name) == getattr(theirs, their_name), ours_name
    assert ours.mixer.time_step_limit == tuple(theirs.time_step_limit)
    assert ours.mixer.norm_eps == theirs.rms_norm_eps
    assert ours.rotary_dim == int(ours.head_dim * theirs.rope_parameters["partial_rotary_factor"])
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    types = ["full_attention" if i in ours.attn_layer_indices else "linear_attention"
             for i in range(ours.num_hidden_layers)]
    assert types == theirs.layers_block_type


@pytest.mark.parametrize("changes", [
    {}, {"mamba_proj_bias": True, "mamba_conv_bias": False, "mamba_d_conv": 3, "rms_norm_eps": 1e-3,
         "time_step_limit": [0.01, 0.5], "tie_word_embeddings": True, "attn_layer_indices": [0, 2],
         "partial_rotary_factor": 1.0, "rope_theta": 5000.0},
    {"mamba_expand": 4, "mamba_n_heads": 16, "mamba_n_groups": 1, "mamba_d_head": 16, "attn_layer_indices": None,
     "attention_bias": True, "mamba_chunk_size": 8},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import BambaConfig

    _compare(parse_hf_config({**RAW, **changes}), BambaConfig(**{**RAW, **changes}))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import BambaConfig

    _compare(parse_hf_config({"architectures": ["BambaForCausalLM"], "model_type": "bamba"}), BambaConfig())


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mamba_d_head": 12}, "mamba_n_heads=8 x mamba_d_head=12 must equal mamba_expand=2 x hidden_size=64"),
    ({"mamba_n_groups": 3}, "mamba_n_groups=3 does not divide mamba_n_heads=8"),
    ({"attn_layer_indices": [3]}, "attn_layer_indices=[3] must be a list of layer indices in 0..2"),
    ({"quantization_config": {"quant_method": "fp8"}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_attention_caches_come_before_the_mamba_layers_states(ops) -> None:
    model = BambaForCausalLM(parse_hf_config(RAW), ops, torch.float32, torch.device("cpu"))
    assert model.kv_cache_shape() == (1, 2, 16)
    assert model.state_cache_shapes() == [(((192, 3), torch.float32), ((8, 16, 16), torch.float32))] * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return reference_pair(tmp_path_factory.mktemp("bamba"), "bamba", seed=4)


def test_variant_attending_first_and_last_with_biases_matches_transformers(tmp_path) -> None:
    """Attention in layers 0 and 2 with biases, Mamba in layer 1 with biased projections, no conv bias and dt clamped
    to [0.3, 0.6], a tied head."""
    model_dir, hf = reference_pair(tmp_path, "bamba", 7, attn_layer_indices=[0, 2], attention_bias=True,
                                   mamba_proj_bias=True, mamba_conv_bias=False, time_step_limit=[0.3, 0.6],
                                   tie_word_embeddings=True)
    llm = recurrent_llm(model_dir, max_num_batched_tokens=16, enable_chunked_prefill=True)
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (1, 23, 40)], 5)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tiny) -> None:
    """Each rank takes 2 query heads and 1 KV head of the attention layer, 4 Mamba heads and 1 group of the others."""
    two_ranks_decode_as_one([random_tokens(30, 256, seed=3), [7], random_tokens(12, 256, seed=4)], tiny[0])
