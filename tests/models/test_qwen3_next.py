"""Qwen3-Next (transformers' Qwen3NextForCausalLM) against transformers' own class on a tiny random checkpoint (Gated
DeltaNet layers with a gated full-attention layer, top-2 of 8 experts beside a gated shared expert): the delta rule's
chunked form against its recurrent form and transformers', varlen prefill and decode and chunked prefill over the
paged cache with carried states, the engine's greedy tokens with chunked prefill, concurrent requests, forced
preemption and a one-token prompt, a block-FP8 copy, two tensor-parallel and two expert-parallel ranks; configs read
as transformers' Qwen3NextConfig reads them, and what is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.gated_deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.loader import load_model
from flashllm.models.qwen3_next import Qwen3NextForCausalLM
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.deepseek import write_block_fp8_copy, write_dequantized_copy
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import (
    assert_logits_close,
    check_chunked_prefill_beside_a_decode,
    check_engine_greedy_against,
    check_varlen_prefill_and_decode,
    hf_greedy,
    hf_logits,
    random_tokens,
)
from flashllm.testing.state_slots import WithStateSlots
from flashllm.testing.tiny_moe import MOE_BASE, moe_reference

VOCAB = MOE_BASE["vocab_size"]
ATOL = 1e-4
# the engine's rows: the cpu backend's kernels round differently from transformers' (one row in 30 near 1.2e-4)
ENGINE_ATOL = 3e-4
RAW = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 256}


# Qwen3-Next-80B-A3B-Instruct's config.json (its sizes and flags)
RELEASED = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
            "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
            "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
            "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
            "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
            "bos_token_id": 151643, "eos_token_id": 151645}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """(transformers Qwen3NextForCausalLM, its directory)."""
    return moe_reference(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", seed=3)


def test_the_model_mixes_linear_and_gated_full_attention_layers(qwen3_next, ops, model_registry) -> None:
    ours, _ = load_model(qwen3_next[1], ops, torch.float32, "cpu", model_registry, progress=False)
    layers = ours.model.layers
    assert type(ours) is Qwen3NextForCausalLM and DECODER_STACK not in ours.fusions()
    assert [layer.self_attn is not None for layer in layers] == [False, True, False, False]
    assert [type(layer.mlp) for layer in layers] == [SparseMoeBlock, SparseMoeBlock, GatedMLP, SparseMoeBlock]
    assert layers[0].mlp.renormalize and layers[0].mlp.shared_expert_gate is not None
    assert ours.kv_cache_shape() == (1, 2, 16)  # the one full-attention layer's cache
    conv, recurrent = ((2 * 2 * 16 + 4 * 24, 3), torch.float32), ((4, 16, 24), torch.float32)
    assert ours.state_cache_shapes() == [(conv, recurrent)] * 3


def _inputs(length: int, heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k (1, L, H, 16) unit rows (q scaled), v (1, L, H, 24), g <= 0 and beta in (0, 1) (1, L, H), a state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, length, heads, 16, generator=gen), dim=-1) for _ in "qk")
    v = torch.randn(1, length, heads, 24, generator=gen)
    g = -torch.rand(1, length, heads, generator=gen) * 0.3
    beta = torch.rand(1, length, heads, generator=gen)
    return q * 16**-0.5, k, v, g, beta, torch.randn(1, heads, 16, 24, generator=gen)


@pytest.mark.parametrize("chunk", [64, 7])
def test_chunked_delta_rule_equals_the_recurrent_form_and_transformers(chunk) -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = _inputs(150, 3, seed=chunk)
    looped, looped_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    chunked, chunked_state = chunked_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], state[0], chunk=chunk)
    theirs, their_state = torch_recurrent_gated_delta_rule(q * 16**0.5, k, v, g, beta, initial_state=state,
                                                           output_final_state=True)
    torch.testing.assert_close(chunked, looped[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked_state, looped_state[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(looped, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(looped_state, their_state, atol=1e-5, rtol=1e-5)


def _driver(qwen3_next, ops, model_registry, paged_driver, num_blocks: int, seed: int):
    """The paged test driver over flashllm's model, with NaN-filled state slots (testing/state_slots.py)."""
    ours, _ = load_model(qwen3_next[1], ops, torch.float32, "cpu", model_registry, progress=False)
    return paged_driver(WithStateSlots(ours, num_blocks), block_size=16, num_blocks=num_blocks, seed=seed)


def test_varlen_prefill_and_decode_match_transformers(qwen3_next, ops, model_registry, paged_driver) -> None:
    driver = _driver(qwen3_next, ops, model_registry, paged_driver, 64, seed=3)
    prompts = [random_tokens(n, VOCAB, seed=100 + n) for n in (1, 7, 65, 130)]  # 130: three delta-rule chunks
    check_varlen_prefill_and_decode(driver, qwen3_next[0], prompts, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(qwen3_next, ops, model_registry, paged_driver) -> None:
    check_chunked_prefill_beside_a_decode(_driver(qwen3_next, ops, model_registry, paged_driver, 32, seed=5),
                                          qwen3_next[0], VOCAB, ATOL)


def test_a_one_token_prompt_joining_a_decode_starts_from_zero_states(qwen3_next, ops, model_registry,
                                                                     paged_driver) -> None:
    """A decode-only step (the vectorized path) whose new sequence's slot holds NaNs: it must not read them."""
    hf_model = qwen3_next[0]
    driver = _driver(qwen3_next, ops, model_registry, paged_driver, 16, seed=7)
    a, b = driver.add_sequence(), driver.add_sequence()
    long, short = random_tokens(20, VOCAB, seed=11), random_tokens(1, VOCAB, seed=12)
    long.append(int(driver.step([(a, long)])[0][-1].argmax()))
    decode, fresh = driver.step([(a, long[-1:]), (b, short)])
    assert_logits_close(decode, hf_logits(hf_model, long)[-1:], ATOL)
    assert_logits_close(fresh, hf_logits(hf_model, short), ATOL)


# the engine tests' requests: four of different lengths, a one-token prompt among them, STEPS greedy tokens each
PROMPTS = [random_tokens(n, VOCAB, seed=n) for n in (1, 15, 31, 46)]
STEPS = 8


@pytest.fixture(scope="module")
def reference_greedy():
    """hf_greedy, each (prompt, steps) computed once for the module's engine tests (transformers' CPU fallbacks of
    the delta rule are the slow part)."""
    done: dict[tuple[tuple[int, ...], int], tuple[list[int], torch.Tensor]] = {}

    def greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        key = (tuple(prompt), steps)
        if key not in done:
            done[key] = hf_greedy(hf_model, prompt, steps)
        return done[key]

    return greedy


def _engine(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "device": "cpu", "block_size": 16, "max_model_len": 80,
                                  "num_kv_blocks": 32, **options})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(qwen3_next, reference_greedy, backend) -> None:
    """The requests together, continuously batched."""
    hf_model, model_dir = qwen3_next
    check_engine_greedy_against(_engine(model_dir, backend=backend), hf_model, PROMPTS, STEPS, ENGINE_ATOL, reference_greedy)


def test_prompts_prefilled_eight_tokens_a_step_match_transformers(qwen3_next, reference_greedy) -> None:
    """Chunked prefill: each prompt's conv and recurrent states cross several steps, beside other requests' decodes."""
    hf_model, model_dir = qwen3_next
    llm = _engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=8)
    check_engine_greedy_against(llm, hf_model, PROMPTS, STEPS, ENGINE_ATOL, reference_greedy)


def test_forced_preemption_recomputes_identically(qwen3_next, reference_greedy) -> None:
    """5 blocks of 16 tokens for the four growing sequences: one is preempted, its states rebuilt from scratch."""
    hf_model, model_dir = qwen3_next
    llm = _engine(model_dir, num_kv_blocks=5)
    check_engine_greedy_against(llm, hf_model, PROMPTS, STEPS, ENGINE_ATOL, reference_greedy)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(qwen3_next, options) -> None:
    """Tensor-parallel ranks hold one key head (and its two value heads) of each Gated DeltaNet layer, two query
    heads of the full attention; expert-parallel ranks hold 4 experts each."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=60 + n) for n in (5, 40)], qwen3_next[1], **options)


def test_the_checkpoint_s_mtp_tensors_are_skipped(qwen3_next, ops, model_registry) -> None:
    ours, _ = load_model(qwen3_next[1], ops, torch.float32, "cpu", model_registry, progress=False)
    loaded = ours.load_weights([("mtp.fc.weight", torch.zeros(64, 128)), ("mtp.norm.weight", torch.zeros(64))])
    assert not any("mtp" in name for name in loaded)
    with pytest.raises(ModelLoadError, match="does not know"):
        ours.load_weights([("model.layers.0.linear_attn.extra", torch.zeros(1))])


def test_a_block_fp8_checkpoint_runs_as_transformers_runs_its_dequantized_weights(qwen3_next, tmp_path) -> None:
    """The -FP8 releases' format: every 2-D projection (in_proj_qkvz, the gated q_proj, experts, ...) as e4m3 codes
    with one scale per 16 x 24 block, dequantized as it loads."""
    from transformers import AutoModelForCausalLM

    fp8_dir = write_block_fp8_copy(qwen3_next[1], tmp_path / "fp8", (16, 24))
    assert load_file(fp8_dir / "model.safetensors")["model.layers.0.linear_attn.in_proj_qkvz.weight"].dtype == (
        torch.float8_e4m3fn)
    hf = AutoModelForCausalLM.from_pretrained(write_dequantized_copy(fp8_dir, tmp_path / "dequantized"),
                                              dtype=torch.float32).eval()
    check_engine_greedy_against(_engine(fp8_dir), hf, PROMPTS[:2], STEPS, ENGINE_ATOL)


@pytest.mark.parametrize("changes", [
    {},
    {"layer_types": ["linear_attention", "full_attention"] * 3, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
     "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 2,
     "mlp_only_layers": [3], "partial_rotary_factor": 0.5, "head_dim": 32, "attention_bias": True,
     "full_attention_interval": 3, "shared_expert_intermediate_size": 0},
    {"full_attention_interval": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                       "partial_rotary_factor": 0.75}, "num_key_value_heads": 4},
    RELEASED,
], ids=["defaults", "explicit", "interval", "released"])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import Qwen3NextConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), Qwen3NextConfig(**{**RAW, **changes})
    sparse = tuple(i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0
                   for i in range(theirs.num_hidden_layers))
    assert ours.full_attention_layers == tuple(t == "full_attention" for t in theirs.layer_types)
    assert ours.sparse_layers == sparse
    for field in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim", "rms_norm_eps",
                  "num_key_value_heads", "max_position_embeddings", "attention_bias", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    rope = theirs.rope_parameters
    assert ours.rotary_dim == int(theirs.head_dim * rope["partial_rotary_factor"])
    assert ours.rope_theta == rope["rope_theta"] and ours.qkv_bias == theirs.attention_bias


def test_the_released_config_counts_about_80b_parameters() -> None:
    assert 79e9 < parse_hf_config(RELEASED).num_parameters < 82e9


@pytest.mark.parametrize(("changes", "message"), [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}, "quant_method='gptq'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "load as float or as block FP8"),
    ({"layer_types": ["linear_attention"] * 5}, "layer_types="),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types="),
    ({"linear_num_key_heads": 4, "linear_num_value_heads": 6}, "not a multiple of linear_num_key_heads"),
    ({"num_experts_per_tok": 600}, "num_experts_per_tok=600 exceeds"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_what_flashllm_cannot_run_is_refused_in_one_line(changes, message) -> None:
    with pytest.raises(ModelLoadError, match=message) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)
