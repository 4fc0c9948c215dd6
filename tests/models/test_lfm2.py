"""LFM2 (transformers' Lfm2ForCausalLM, LiquidAI/LFM2-*): config.json read as Lfm2Config reads it, the hybrid stack's
logits through a paged driver that keeps each sequence's convolution state in its own slot, and the engine's greedy
tokens against transformers with prompts chunked across steps, batched, preempted and recomputed, and one token
long, on two tensor-parallel ranks too. The tiny preset's engine parity with transformers also runs in
test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import (
    check_chunked_prefill_beside_a_decode,
    check_engine_greedy_against,
    check_varlen_prefill_and_decode,
    random_tokens,
)
from flashllm.testing.state_slots import (
    WithStateSlots,
    check_fresh_sequences_in_reused_slots,
    check_preemption_recomputes_states,
    check_states_across_prefill_chunks,
)
from flashllm.testing.tiny_models import build_tiny_model

RAW = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 64, "intermediate_size": 192,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "layer_types": ["conv", "full_attention", "conv"]}
VOCAB = 256


def _their_config(fields: dict):
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    theirs = Lfm2Config(**fields)
    return theirs, Lfm2MLP(theirs).w1.out_features


@pytest.mark.parametrize("changes", [
    {},
    {"layer_types": None, "full_attn_idxs": [0, 2], "tie_embedding": False, "block_ff_dim": 300},
    {"block_auto_adjust_ff_dim": False, "norm_eps": 1e-3, "rope_theta": 5e5, "head_dim": 32, "conv_L_cache": 4,
     "conv_bias": True, "max_position_embeddings": 4096},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, "block_ffn_dim_multiplier": 1.5,
     "block_multiple_of": 64, "hidden_act": "gelu", "attention_bias": True},  # the last two LFM2 does not read
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    fields = {**RAW, **changes}
    ours = parse_hf_config(fields)
    theirs, ff_dim = _their_config({k: v for k, v in fields.items() if v is not None})
    assert ours.intermediate_size == ff_dim
    assert ours.attention_layers == tuple(t == "full_attention" for t in theirs.layer_types)
    assert ours.head_dim == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == theirs.rope_parameters.get("factor")
    assert (ours.rms_norm_eps, ours.conv_kernel, ours.conv_bias) == (theirs.norm_eps, theirs.conv_L_cache,
                                                                      theirs.conv_bias)
    assert (ours.qk_norm, ours.attention_bias, ours.hidden_act) == (True, False, "silu")
    for field in ("tie_word_embeddings", "max_position_embeddings", "num_key_value_heads", "bos_token_id",
                  "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_a_null_multiplier_skips_the_rounding_as_lfm2_mlp_does() -> None:
    """Lfm2MLP takes 2/3 of intermediate_size unrounded without block_ffn_dim_multiplier (transformers 5.25's config
    class no longer accepts the null that older LFM2 configs could carry)."""
    assert parse_hf_config({**RAW, "intermediate_size": 300, "block_ffn_dim_multiplier": None}).intermediate_size == 200


def test_fields_left_out_take_transformers_defaults() -> None:
    ours = parse_hf_config({"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2"})
    theirs, ff_dim = _their_config({})
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.intermediate_size == ff_dim == 8192
    assert ours.attention_layers == (True,) * theirs.num_hidden_layers  # no layer_types, no full_attn_idxs
    assert (ours.rms_norm_eps, ours.rope_theta, ours.conv_kernel, ours.conv_bias) == (
        theirs.norm_eps, theirs.rope_parameters["rope_theta"], theirs.conv_L_cache, theirs.conv_bias)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"layer_types": ["conv", "sliding_attention", "conv"]}, "each one of ('conv', 'full_attention')"),
    ({"layer_types": ["conv", "full_attention"]}, "expected 3 entries"),
    ({"layer_types": None, "full_attn_idxs": "1"}, "full_attn_idxs='1' must be a list of layer indices"),
    ({"conv_bias": "yes"}, "conv_bias='yes' must be true or false"),
    ({"block_ffn_dim_multiplier": -1.0}, "block_ffn_dim_multiplier=-1.0 must be a positive number or null"),
    ({"conv_L_cache": 0}, "conv_L_cache"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def lfm2_pair(tmp_path_factory):
    """(flashllm model, transformers model, model dir) of the tiny preset, float32 on the reference ops."""
    from transformers import AutoModelForCausalLM

    from flashllm.backends.reference import reference_op_table
    from flashllm.testing.loading import builtin_registry

    model_dir = build_tiny_model(tmp_path_factory.mktemp("lfm2"), "lfm2", seed=1, tokenizer=False)
    ours, _ = load_model(model_dir, reference_op_table(), torch.float32, "cpu", builtin_registry(), progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, theirs, model_dir


def test_paged_prefill_decode_and_chunks_match_transformers(lfm2_pair, paged_driver) -> None:
    """A varlen prefill of prompts of 1 to 70 tokens then decodes of all of them together; a 150-token prompt in
    chunks, each beside another sequence's decode: every logits row is transformers' for its context (each sequence's
    states in a NaN-filled slot of its own)."""
    ours, theirs, _ = lfm2_pair
    assert [layer.conv is None for layer in ours.model.layers] == [False, True, False, False]
    prompts = [random_tokens(n, VOCAB, seed=n) for n in (1, 2, 3, 17, 70)]
    check_varlen_prefill_and_decode(paged_driver(WithStateSlots(ours, 64), block_size=16, num_blocks=64, seed=3),
                                    theirs, prompts)
    check_chunked_prefill_beside_a_decode(paged_driver(WithStateSlots(ours, 32), block_size=16, num_blocks=32, seed=5),
                                          theirs, VOCAB)


def test_a_pass_without_state_slots_starts_every_sequence_from_zeros(lfm2_pair, paged_driver) -> None:
    """A pass that keeps no state (the memory profile's, a scoring pass) needs no state tensors: prefill logits."""
    ours, theirs, _ = lfm2_pair
    driver = paged_driver(ours, block_size=16, num_blocks=16)
    prompts = [random_tokens(n, VOCAB, seed=40 + n) for n in (5, 33)]
    for prompt, logits in zip(prompts, driver.step([(driver.add_sequence(), p) for p in prompts]), strict=True):
        torch.testing.assert_close(logits, theirs(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("check", [check_states_across_prefill_chunks, check_fresh_sequences_in_reused_slots,
                                   check_preemption_recomputes_states],
                         ids=["prefill-chunks", "reused-slots", "preemption"])
def test_engine_gives_transformers_tokens_as_states_cross_chunks_slots_and_preemption(check, lfm2_pair) -> None:
    """8-token prefill chunks with a one-token prompt; one-token prompts in slots other sequences left; a cache too
    small for four growing sequences (preempted and recomputed from scratch, asserted)."""
    _, theirs, model_dir = lfm2_pair
    check(model_dir, theirs, VOCAB)


def _llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "device": "cpu", "block_size": 16, "max_model_len": 128,
                                  "num_kv_blocks": 40, **options})


@pytest.mark.parametrize("changes", [
    {"conv_L_cache": 4, "conv_bias": False, "tie_word_embeddings": False},
    {"layer_types": None, "full_attn_idxs": [], "num_hidden_layers": 2},  # no attention layer: no paged KV at all
], ids=["width-4-unbiased-untied", "convolutions-only"])
def test_variants_match_transformers(changes, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "lfm2", seed=4, tokenizer=False, **changes)
    llm = _llm(model_dir, max_num_batched_tokens=16)
    model = llm.engine.parts.model
    assert model.kv_cache_shape()[0] == sum(layer.conv is None for layer in model.model.layers)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.config.use_cache = False  # transformers' cache cannot size a mask without an attention layer
    check_engine_greedy_against(llm, hf, [random_tokens(n, VOCAB, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads and its channels of B, C, x, the convolution and out_proj's input."""
    model_dir = build_tiny_model(tmp_path, "lfm2", seed=2, tokenizer=False)
    two_ranks_decode_as_one([random_tokens(30, VOCAB, seed=3), [7, 3, 250], [5]], model_dir)
