"""Nemotron-H (transformers' NemotronHForCausalLM): config.json read as NemotronHConfig reads it, and the engine's
greedy tokens and logits equal to transformers' with Mamba-2 layers' states carried across prefill chunks and
recomputed after preemption beside NoPE attention and relu2 MLP layers, and on two tensor-parallel ranks. The tiny
preset's whole-prompt paged forward and engine parity also run in test_parity_forward.py and test_engine_parity.py; the
states through chunks, reused slots and preemption in test_mamba2_family_states.py."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.nemotron_h import NemotronHForCausalLM
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.hybrid_checks import reference_pair
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.state_slots import (
    recurrent_llm,
)

RAW = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 64,
       "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "vocab_size": 256, "hybrid_override_pattern": "M-*M-", "mamba_num_heads": 8, "mamba_head_dim": 16,
       "n_groups": 2, "ssm_state_size": 16}
_MIXER = {"num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "n_groups": "n_groups",
          "state_size": "ssm_state_size", "conv_kernel": "conv_kernel", "use_bias": "use_bias",
          "use_conv_bias": "use_conv_bias", "chunk_size": "chunk_size"}
_CHARS = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}


def _compare(ours, theirs) -> None:
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "bos_token_id", "eos_token_id", "mlp_bias"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert not ours.tie_word_embeddings  # transformers' NemotronHForCausalLM ties nothing whatever the config says
    assert ours.rms_norm_eps == ours.mixer.norm_eps == theirs.layer_norm_epsilon
    assert ours.hidden_act == theirs.mlp_hidden_act
    for ours_name, their_name in _MIXER.items():
        assert getattr(ours.mixer, ours_name) == getattr(theirs, their_name), ours_name
    assert ours.mixer.time_step_limit == tuple(theirs.time_step_limit)
    assert ours.pattern == "".join(_CHARS[t] for t in theirs.layers_block_type)


@pytest.mark.parametrize("changes", [
    {}, {"use_bias": True, "use_conv_bias": False, "conv_kernel": 3, "layer_norm_epsilon": 1e-3,
         "time_step_limit": [0.01, 0.5], "tie_word_embeddings": True, "mlp_hidden_act": "relu", "mlp_bias": True},
    {"hybrid_override_pattern": None, "layers_block_type": ["full_attention", "mlp", "linear_attention"],
     "mamba_num_heads": 4, "mamba_head_dim": 40, "n_groups": 1, "chunk_size": 8},
    {"mamba_n_groups": 4, "mamba_d_conv": 2, "mamba_chunk_size": 32, "mamba_conv_bias": False},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import NemotronHConfig

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    _compare(parse_hf_config(raw), NemotronHConfig(**raw))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import NemotronHConfig

    raw = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": "M*-"}
    _compare(parse_hf_config(raw), NemotronHConfig(hybrid_override_pattern="M*-"))


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hybrid_override_pattern": "M*E"}, "MoE layers ('E' / 'moe' in the layer pattern) are not supported"),
    ({"hybrid_override_pattern": None}, "MoE layers"),  # NemotronHConfig's default layers include a MoE one
    ({"hybrid_override_pattern": "M*x"}, "hybrid_override_pattern='M*x' must be a non-empty string"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu' is not supported"),
    ({"mlp_hidden_act": "swish"}, "hidden_act='swish' is not supported"),
    ({"n_groups": 3}, "n_groups=3 does not divide mamba_num_heads=8"),
    ({"quantization_config": {"quant_method": "fp8"}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config(raw)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_only_mamba_layers_keep_states_and_only_attention_layers_page(ops) -> None:
    model = NemotronHForCausalLM(parse_hf_config(RAW), ops, torch.float32, torch.device("cpu"))
    assert model.kv_cache_shape() == (1, 2, 16)
    assert model.state_cache_shapes() == [(((192, 3), torch.float32), ((8, 16, 16), torch.float32))] * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return reference_pair(tmp_path_factory.mktemp("nemotron_h"), "nemotron_h", seed=4)


def test_variant_with_biases_and_attention_first_matches_transformers(tmp_path) -> None:
    """Attention first, biased Mamba projections, no conv bias, dt clamped to [0.3, 0.6], a biased relu MLP, and
    tie_word_embeddings set, which transformers' model ignores (its head stays its own)."""
    model_dir, hf = reference_pair(tmp_path, "nemotron_h", 7, hybrid_override_pattern="*M-M", num_hidden_layers=4,
                                   use_bias=True, mamba_conv_bias=False, time_step_limit=[0.3, 0.6],
                                   mlp_hidden_act="relu", mlp_bias=True, tie_word_embeddings=True)
    llm = recurrent_llm(model_dir, max_num_batched_tokens=16, enable_chunked_prefill=True)
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (1, 23, 40)], 5)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tiny) -> None:
    """Each rank takes 2 query heads and 1 KV head of the attention layer, 4 Mamba heads and 1 group, and half of
    each MLP's features."""
    two_ranks_decode_as_one([random_tokens(30, 256, seed=3), [7], random_tokens(12, 256, seed=4)], tiny[0])
