"""OLMoE (transformers' OlmoeForCausalLM) against transformers' own class on tiny random checkpoints (OLMo 2's
whole-projection q / k norms, top-3 of 8 softmax-scored experts not renormalized): varlen prefill and decode over the
paged cache, chunked prefill beside a decode, the engine's greedy tokens and logits on the cpu and reference
backends, the renormalized variant, two tensor-parallel and two expert-parallel ranks; configs read as transformers'
OlmoeConfig reads them."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.loader import load_model
from flashllm.models.olmoe import OlmoeAttention, OlmoeForCausalLM
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import (
    check_engine_greedy_against,
    random_tokens,
)
from flashllm.testing.tiny_moe import MOE_BASE, build_moe_model, check_paged_parity, moe_reference

VOCAB = MOE_BASE["vocab_size"]
PROMPT_LENGTHS = (1, 7, 63, 65, 130)
ATOL = 1e-4
RAW = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 64, "intermediate_size": 48,
       "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    """(transformers OlmoeForCausalLM, its directory)."""
    return moe_reference(tmp_path_factory.mktemp("olmoe"), "olmoe", seed=3)


def test_the_model_has_whole_projection_norms_and_unrenormalized_experts(olmoe, ops, model_registry) -> None:
    _, model_dir = olmoe
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    first = ours.model.layers[0]
    assert type(ours) is OlmoeForCausalLM and type(first.self_attn) is OlmoeAttention
    assert first.self_attn.q_norm.weight.shape == (64,) and first.self_attn.k_norm.weight.shape == (32,)
    assert type(first.mlp) is SparseMoeBlock and not first.mlp.renormalize and first.mlp.top_k == 3
    assert DECODER_STACK not in ours.fusions()  # the fused decode stack norms each head, not whole projections


def test_varlen_prefill_and_decode_match_transformers(olmoe, ops, model_registry, paged_driver) -> None:
    check_paged_parity(olmoe, ops, model_registry, paged_driver, VOCAB, PROMPT_LENGTHS, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(olmoe, ops, model_registry, paged_driver) -> None:
    check_paged_parity(olmoe, ops, model_registry, paged_driver, VOCAB, None, ATOL)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(olmoe, backend) -> None:
    hf_model, model_dir = olmoe
    llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=256,
              num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in PROMPT_LENGTHS], 12, ATOL)


def test_renormalized_top_k_weights_match_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path, "olmoe", seed=4, norm_topk_prob=True, attention_bias=True)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    first = llm.engine.parts.model.model.layers[0]
    assert first.mlp.renormalize and first.self_attn.o_proj.bias is not None
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (5, 70)], 8, ATOL)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(olmoe, options) -> None:
    """Tensor parallel ranks gather the q / k slices to norm them whole; expert parallel ranks hold 4 experts each."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=60 + n) for n in (5, 40)], olmoe[1], **options)


@pytest.mark.parametrize("changes", [{}, {"num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                          "num_key_value_heads": 2}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import OlmoeConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), OlmoeConfig(**{**RAW, **changes})
    assert (ours.num_experts, ours.num_experts_per_tok, ours.norm_topk_prob) == (
        theirs.num_experts, theirs.num_experts_per_tok, theirs.norm_topk_prob)
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.num_key_value_heads) == (
        theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.num_key_value_heads)
    assert ours.moe_intermediate_size == theirs.intermediate_size and ours.shared_expert_intermediate_size == 0


def test_clip_qkv_is_refused_in_one_line() -> None:
    with pytest.raises(ModelLoadError, match="clip_qkv=8.0 is not supported") as info:
        parse_hf_config({**RAW, "clip_qkv": 8.0})
    assert "\n" not in str(info.value)
