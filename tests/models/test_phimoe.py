"""PhiMoE (PhimoeForCausalLM) against transformers on tiny random checkpoints (LayerNorms, biased attention and LM
head, SparseMixer's two picks, LongRoPE with mscales): SparseMixer against transformers' own function, varlen prefill
and decode over the paged cache, the engine's greedy tokens and logits, transformers 5's stacked layout, the long
LongRoPE set, two tensor-parallel and two expert-parallel ranks; configs read as transformers' PhimoeConfig reads
them, and what flashllm cannot run refused in one line."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.loader import load_model
from flashllm.models.phi import BiasedLMHead
from flashllm.models.phi3 import LongRopeRotaryEmbedding
from flashllm.models.phimoe import PhimoeForCausalLM, PhimoeSparseMoeBlock, sparsemixer
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, check_varlen_prefill_and_decode, random_tokens
from flashllm.testing.tiny_moe import MOE_BASE, PHIMOE_PRESET, build_moe_model

VOCAB = MOE_BASE["vocab_size"]
PROMPT_LENGTHS = (1, 7, 63, 65, 130)  # within the preset's original context (256)
ATOL = 1e-4
RAW = {"architectures": ["PhimoeForCausalLM"], "model_type": "phimoe", "hidden_size": 64, "intermediate_size": 48,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "num_local_experts": 4}
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "short_mscale": 1.24,
            "long_mscale": 1.3, "original_max_position_embeddings": 128}
# Phi-3.5-MoE-instruct's config.json fields (sizes shrunk): its Hub architecture name, biases, full-length window
HUB = {"architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "lm_head_bias": True, "eos_token_id": 32000,
       "input_jitter_noise": 0.01, "router_jitter_noise": 0.01, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "max_position_embeddings": 512, "sliding_window": 512, "original_max_position_embeddings": 128,
       "rope_scaling": LONGROPE, "vocab_size": 32064, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def phimoe(tmp_path_factory):
    """(transformers PhimoeForCausalLM, its directory)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path_factory.mktemp("phimoe"), "phimoe", seed=3)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), model_dir


@pytest.mark.parametrize("jitter_eps", [0.0, 0.01, 0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparsemixer_is_transformers_inference_routing(jitter_eps, dtype) -> None:
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

    gen = torch.Generator().manual_seed(int(jitter_eps * 100))
    logits = (torch.randn(512, 16, generator=gen) * 1.5).to(dtype)
    logits[:8, :3] = logits[:8, :1]  # ties at the top
    weights, ids = sparsemixer(logits, jitter_eps)
    hf_weights, hf_ids = hf_sparsemixer(logits, jitter_eps=jitter_eps, training=False)
    assert torch.equal(ids, hf_ids) and (ids[:, 0] != ids[:, 1]).all()
    assert weights.dtype == torch.float32 and torch.equal(weights, hf_weights.float())
    if jitter_eps >= 0.1:  # the band holds several experts: the weights are not all 1
        assert (weights < 1).float().mean() > 0.2


def test_the_model_is_layernormed_biased_and_routed_by_sparsemixer(phimoe, ops, model_registry) -> None:
    ours, _ = load_model(phimoe[1], ops, torch.float32, "cpu", model_registry, progress=False)
    first = ours.model.layers[0]
    assert type(ours) is PhimoeForCausalLM and type(first.mlp) is PhimoeSparseMoeBlock
    assert type(first.input_layernorm) is LayerNorm and first.input_layernorm.bias is not None
    assert type(ours.model.norm) is LayerNorm and type(ours.lm_head) is BiasedLMHead
    assert first.self_attn.o_proj.bias is not None and first.mlp.jitter_eps == 0.1
    assert type(ours.model.rotary_emb) is LongRopeRotaryEmbedding and ours.reads_prompt_lens
    assert DECODER_STACK not in ours.fusions()


def test_varlen_prefill_and_decode_match_transformers(phimoe, ops, model_registry, paged_driver) -> None:
    hf_model, model_dir = phimoe
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=16, num_blocks=64, seed=3)
    check_varlen_prefill_and_decode(driver, hf_model, [random_tokens(n, VOCAB, seed=100 + n) for n in PROMPT_LENGTHS],
                                    ATOL)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(phimoe, backend) -> None:
    hf_model, model_dir = phimoe
    llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=256,
              num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (1, 40, 100)], 6, ATOL)


def test_stacked_experts_plain_rope_and_unbiased_head_match_transformers(tmp_path) -> None:
    """transformers 5's own layout (mlp.router, experts.gate_up_proj / down_proj), default RoPE, no biases, a window
    shorter than the prompts, the default jitter band."""
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path, "phimoe", seed=4, original_format=False, rope_parameters=None,
                                attention_bias=False, lm_head_bias=False, router_jitter_noise=0.01, sliding_window=24)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert model.model.layers[0].self_attn.o_proj.bias is None and not isinstance(model.lm_head, BiasedLMHead)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (5, 70)], 8, ATOL)


def test_prompts_past_the_original_context_match_where_both_sets_agree(tmp_path) -> None:
    """With equal factor sets transformers 5.25 (which always rotates by the short set) and flashllm (the long set
    past O) rotate alike, so prompts past O check the long table's rows and long_mscale."""
    from transformers import AutoModelForCausalLM

    rope = {**PHIMOE_PRESET[2]["rope_parameters"], "original_max_position_embeddings": 64}
    rope["long_factor"] = rope["short_factor"]
    model_dir = build_moe_model(tmp_path, "phimoe", seed=5, rope_parameters=rope)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (20, 90)], 6, ATOL)


def test_the_long_table_is_the_long_factors_times_long_mscale(phimoe, ops, model_registry) -> None:
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    hf_model, model_dir = phimoe
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    rotary, rope = ours.model.rotary_emb, hf_model.config.rope_parameters
    original = rope["original_max_position_embeddings"]
    positions = torch.arange(0, 512, 37, dtype=torch.float32)
    for long, first_row, mscale in ((False, 0, rope["short_mscale"]), (True, original, rope["long_mscale"])):
        inv_freq, _ = _compute_longrope_parameters(hf_model.config, seq_len=original + 1 if long else None)
        rows = positions[positions < (512 if long else original)]
        angles = rows[:, None] * inv_freq[None, :]
        expected = torch.cat((angles.cos(), angles.sin()), dim=-1) * mscale
        torch.testing.assert_close(rotary.cos_sin_cache[first_row + rows.long()], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(phimoe, options) -> None:
    """Tensor parallel ranks split heads, biases, the LM head's bias and each expert's features; expert parallel
    ranks hold 2 experts each."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=60 + n) for n in (5, 40)], phimoe[1], **options)


@pytest.mark.parametrize("changes", [{}, HUB, {"rope_parameters": {**LONGROPE, "rope_theta": 5e5}},
                                     {"rope_scaling": {k: v for k, v in LONGROPE.items()
                                                       if k != "original_max_position_embeddings"},
                                      "max_position_embeddings": 256, "tie_word_embeddings": True,
                                      "num_key_value_heads": 4, "sliding_window": 32}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import PhimoeConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), PhimoeConfig(**{**RAW, **changes})
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size)
    for field in ("rms_norm_eps", "max_position_embeddings", "num_key_value_heads", "tie_word_embeddings",
                  "lm_head_bias", "router_jitter_noise", "bos_token_id", "eos_token_id", "vocab_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.qkv_bias == theirs.attention_bias and ours.rope_theta == theirs.rope_parameters["rope_theta"]
    window = theirs.sliding_window
    assert ours.sliding_windows == (None if window is None or window >= theirs.max_position_embeddings else window,) * 2
    if theirs.rope_parameters["rope_type"] == "default":
        assert ours.rope_scaling is None
        return
    rope = theirs.rope_parameters
    assert ours.rope_scaling["original_max_position_embeddings"] == rope["original_max_position_embeddings"]
    assert ours.rope_scaling["mscales"] == (rope["short_mscale"], rope["long_mscale"])


def test_fields_left_out_take_phimoeconfig_defaults() -> None:
    from transformers import PhimoeConfig

    raw = {"architectures": ["PhimoeForCausalLM"], "model_type": "phimoe"}
    ours, theirs = parse_hf_config(raw), PhimoeConfig()
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings", "router_jitter_noise", "lm_head_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_experts, ours.num_experts_per_tok) == (theirs.num_local_experts, theirs.num_experts_per_tok)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert not ours.qkv_bias and ours.sliding_windows == (None,) * 32


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_experts_per_tok": 3}, "SparseMixer routes exactly 2 experts"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported for PhiMoE"),
    ({"rope_scaling": {k: v for k, v in LONGROPE.items() if k != "long_mscale"}}, "must both be positive numbers"),
    ({"rope_scaling": {**LONGROPE, "short_factor": [1.0] * 3}}, "invalid longrope settings"),
    ({"rope_scaling": {**LONGROPE, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5 is not supported"),
    ({"router_jitter_noise": -0.1}, "router_jitter_noise=-0.1 must be a non-negative number"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}, "loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)
