"""FlexOlmo (transformers' FlexOlmoForCausalLM: OLMo 2's post-norms and whole-projection q / k norms around OLMoE's
top-3 of 8 experts) against transformers' own class on tiny random checkpoints: varlen prefill and decode over the
paged cache, chunked prefill beside a decode, the engine's greedy tokens and logits, the renormalized and biased
variant, two tensor-parallel and two expert-parallel ranks; configs read as transformers' FlexOlmoConfig reads them."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.flex_olmo import FlexOlmoForCausalLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.loader import load_model
from flashllm.models.olmo2 import Olmo2Attention, Olmo2DecoderLayer
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
RAW = {"architectures": ["FlexOlmoForCausalLM"], "model_type": "flex_olmo", "hidden_size": 64,
       "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.fixture(scope="module")
def flex_olmo(tmp_path_factory):
    """(transformers FlexOlmoForCausalLM, its directory)."""
    return moe_reference(tmp_path_factory.mktemp("flex_olmo"), "flex_olmo", seed=3)


def test_the_layers_are_post_norm_with_whole_projection_norms_and_experts(flex_olmo, ops, model_registry) -> None:
    _, model_dir = flex_olmo
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    first = ours.model.layers[0]
    assert type(ours) is FlexOlmoForCausalLM and type(first) is Olmo2DecoderLayer
    assert type(first.self_attn) is Olmo2Attention and not hasattr(first, "input_layernorm")
    assert first.self_attn.q_norm.weight.shape == (64,) and first.self_attn.k_norm.weight.shape == (32,)
    assert type(first.mlp) is SparseMoeBlock and not first.mlp.renormalize and first.mlp.top_k == 3
    assert DECODER_STACK not in ours.fusions()


def test_varlen_prefill_and_decode_match_transformers(flex_olmo, ops, model_registry, paged_driver) -> None:
    check_paged_parity(flex_olmo, ops, model_registry, paged_driver, VOCAB, PROMPT_LENGTHS, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(flex_olmo, ops, model_registry, paged_driver) -> None:
    check_paged_parity(flex_olmo, ops, model_registry, paged_driver, VOCAB, None, ATOL)


def test_engine_greedy_tokens_and_logits_match_transformers(flex_olmo) -> None:
    hf_model, model_dir = flex_olmo
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (5, 63, 130)], 12, ATOL)


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "stacked"])
def test_renormalized_biased_variant_matches_transformers(original_format, tmp_path) -> None:
    """norm_topk_prob and attention biases, from per-expert tensors and from transformers 5's stacked ones."""
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path, "flex_olmo", seed=4, original_format=original_format, norm_topk_prob=True,
                                attention_bias=True, num_key_value_heads=4)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    first = llm.engine.parts.model.model.layers[0]
    assert first.mlp.renormalize and first.self_attn.o_proj.bias is not None
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (5, 70)], 8, ATOL)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(flex_olmo, options) -> None:
    """Tensor parallel ranks gather the q / k slices to norm them whole; expert parallel ranks hold 4 experts each."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=60 + n) for n in (5, 40)], flex_olmo[1], **options)


def _compare(ours, theirs) -> None:
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                  "num_experts", "num_experts_per_tok", "norm_topk_prob", "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.moe_intermediate_size == theirs.intermediate_size and ours.shared_expert_intermediate_size == 0


@pytest.mark.parametrize("changes", [{}, {"num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                          "num_key_value_heads": 2, "rms_norm_eps": 1e-5},
                                     {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
                                      "tie_word_embeddings": True, "attention_bias": True}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import FlexOlmoConfig

    _compare(parse_hf_config({**RAW, **changes}), FlexOlmoConfig(**{**RAW, **changes}))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import FlexOlmoConfig

    _compare(parse_hf_config({"architectures": ["FlexOlmoForCausalLM"], "model_type": "flex_olmo"}), FlexOlmoConfig())


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_experts_per_tok": 9, "num_experts": 8}, "num_experts_per_tok=9"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "FlexOlmoForCausalLM loads float checkpoints"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)
