"""Mamba-2 (transformers' Mamba2ForCausalLM): config.json read as Mamba2Config reads it, the blockwise SSD scan equal
to the token-by-token recurrence, and the engine's greedy tokens and logits equal to transformers' with each
sequence's conv and SSM states carried across prefill chunks, concurrent requests, preemption (recomputed from
scratch) and one-token prompts, and on two tensor-parallel ranks. The tiny preset's whole-prompt paged forward and
engine parity also run in test_parity_forward.py and test_engine_parity.py; the states through chunks, reused slots and
preemption in test_mamba2_family_states.py."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mamba2 import ssd_sequence, ssd_step
from flashllm.models.mamba2 import Mamba2ForCausalLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.hybrid_checks import reference_pair
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.state_slots import (
    recurrent_llm,
)

RAW = {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": 64, "num_heads": 8,
       "head_dim": 16, "n_groups": 2, "state_size": 16, "num_hidden_layers": 2, "vocab_size": 256}
_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_norm_epsilon", "residual_in_fp32",
           "tie_word_embeddings", "bos_token_id", "eos_token_id")
_MIXER = ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "use_bias", "use_conv_bias", "chunk_size")


def _compare(ours, theirs) -> None:
    for name in _FIELDS:
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in _MIXER:
        assert getattr(ours.mixer, name) == getattr(theirs, name), name
    assert ours.mixer.time_step_limit == tuple(theirs.time_step_limit)
    assert ours.mixer.norm_eps == theirs.layer_norm_epsilon
    assert ours.mixer.inner_size == int(theirs.expand * theirs.hidden_size)


@pytest.mark.parametrize("changes", [
    {}, {"use_bias": True, "use_conv_bias": False, "conv_kernel": 3, "chunk_size": 64, "layer_norm_epsilon": 1e-3,
         "time_step_limit": [0.01, 0.5], "residual_in_fp32": False, "tie_word_embeddings": True},
    {"expand": 4, "num_heads": 16, "n_groups": 1, "eos_token_id": [2, 5], "max_position_embeddings": 64},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import Mamba2Config

    _compare(parse_hf_config({**RAW, **changes}), Mamba2Config(**{**RAW, **changes}))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import Mamba2Config

    _compare(parse_hf_config({"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"}), Mamba2Config())


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_heads": 6}, "num_heads=6 x head_dim=16 must equal expand=2 x hidden_size=64"),
    ({"n_groups": 3, "num_heads": 8}, "n_groups=3 does not divide num_heads=8"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit=[0.5, 0.1] must be [min, max]"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_tensor_parallel_size_that_splits_a_group_is_refused(ops) -> None:
    config = parse_hf_config(RAW)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .* 8 heads and 2 groups") as info:
        Mamba2ForCausalLM(config, ops, torch.float32, torch.device("cpu"), tp_rank=0, tp_size=4)
    assert "\n" not in str(info.value)


def test_blockwise_scan_equals_the_token_by_token_recurrence() -> None:
    """ssd_sequence over blocks of 4 (the last one short) from a non-zero state gives every output and the final state
    the step-by-step recurrence gives."""
    gen = torch.Generator().manual_seed(0)
    length, heads, head_dim, n = 11, 3, 5, 4
    x, b, c = (torch.randn(length, heads, d, generator=gen) for d in (head_dim, n, n))
    dt = torch.rand(length, heads, generator=gen) + 0.1
    a, h0 = -torch.rand(heads, generator=gen) - 0.5, torch.randn(heads, head_dim, n, generator=gen)
    y, h = ssd_sequence(x, dt, a, b, c, h0, chunk_size=4)
    state, rows = h0[None], []
    for t in range(length):
        row, state = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], state)
        rows.append(row[0])
    torch.testing.assert_close(y, torch.stack(rows), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, state[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return reference_pair(tmp_path_factory.mktemp("mamba2"), "mamba2", seed=4)


def test_variant_with_biases_limits_and_tied_head_matches_transformers(tmp_path) -> None:
    """Biased in_proj / out_proj, no conv bias, a width-3 conv, dt clamped to [0.3, 0.6], one group, blocks of 5,
    a residual stream in the model dtype and a head tied to the embedding."""
    model_dir, hf = reference_pair(tmp_path, "mamba2", 7, use_bias=True, use_conv_bias=False, conv_kernel=3,
                                   time_step_limit=[0.3, 0.6], n_groups=1, chunk_size=5, residual_in_fp32=False,
                                   tie_word_embeddings=True)
    llm = recurrent_llm(model_dir, max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert llm.engine.parts.model.lm_head.weight is llm.engine.parts.model.backbone.embeddings.weight
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (1, 23, 40)], 6)


def test_bfloat16_engine_follows_transformers_bfloat16(tiny) -> None:
    """In bf16 (conv states in bf16, SSM states in fp32) the greedy tokens of a short continuation stay
    transformers' bf16 ones."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    llm = recurrent_llm(model_dir, dtype="bfloat16", max_num_batched_tokens=8, enable_chunked_prefill=True)
    shapes = llm.engine.parts.model.state_cache_shapes()
    assert [dtype for _, dtype in shapes[0]] == [torch.bfloat16, torch.float32]
    check_engine_greedy_against(llm, hf, [random_tokens(20, 256, seed=3)], 4, atol=0.1)


def test_weight_only_int8_quantizes_the_mixer_projections_and_keeps_the_tokens(tiny) -> None:
    """--quant_type w8a16 turns in_proj and out_proj into int8 weights (the conv, dt / A / D and norms stay float);
    the tiny model's greedy tokens stay the float engine's."""
    model_dir, _ = tiny
    prompts, params = [random_tokens(20, 256, seed=1)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    float_out = recurrent_llm(model_dir).generate(prompts, params, use_tqdm=False)
    quantized = recurrent_llm(model_dir, quant_type="w8a16")
    mixer = quantized.engine.parts.model.backbone.layers[0].mixer
    assert mixer.in_proj.qweight.scheme == mixer.out_proj.qweight.scheme == "w8a16"
    out = quantized.generate(prompts, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == float_out[0].outputs[0].token_ids


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tiny) -> None:
    """Each rank takes 4 of the 8 heads and 1 of the 2 groups: its rows of in_proj's five parts, its conv channels
    of x, B and C, its heads' dt_bias / A_log / D and its channels of the gated norm."""
    model_dir, _ = tiny
    two_ranks_decode_as_one([random_tokens(30, 256, seed=3), [7], random_tokens(12, 256, seed=4)], model_dir)


def test_each_rank_keeps_its_heads_states_and_no_attention_cache(ops) -> None:
    """Rank 1 of 2: conv channels 64 of x + 16 of B + 16 of C over K - 1 = 3 inputs, 4 heads' (16, 16) SSM states."""
    model = Mamba2ForCausalLM(parse_hf_config(RAW), ops, torch.bfloat16, torch.device("cpu"), 1, 2)
    assert model.kv_cache_shape()[0] == 0
    assert model.state_cache_shapes() == [(((96, 3), torch.bfloat16), ((4, 16, 16), torch.float32))] * 2
