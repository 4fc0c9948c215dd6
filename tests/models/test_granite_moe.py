"""IBM Granite-MoE (transformers' GraniteMoeForCausalLM) against transformers' own class on a tiny random checkpoint
(Granite's four multipliers far from 1, top-2 of 4 experts): varlen prefill and decode over the paged cache, chunked
prefill beside a decode, the engine's greedy tokens and logits, transformers 5's checkpoint names, two
tensor-parallel and two expert-parallel ranks, int8 experts; pre-quantized checkpoints refused."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.granite_moe import GraniteMoeForCausalLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD
from flashllm.sampling_params import SamplingParams
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import (
    check_engine_greedy_against,
    random_tokens,
)
from flashllm.testing.tiny_moe import GRANITE_MOE_PRESET, MOE_BASE, build_moe_model, check_paged_parity, moe_reference

VOCAB = MOE_BASE["vocab_size"]
PROMPT_LENGTHS = (1, 7, 63, 65, 130)
ATOL = 1e-4


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(transformers GraniteMoeForCausalLM, its directory)."""
    return moe_reference(tmp_path_factory.mktemp("granitemoe"), "granitemoe", seed=5)


def test_the_model_is_granite_s_stack_with_sparse_mlps(granite, ops, model_registry) -> None:
    _, model_dir = granite
    ours, config = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert type(ours) is GraniteMoeForCausalLM
    assert (config.num_experts, config.num_experts_per_tok, config.residual_multiplier) == (4, 2, 0.22)
    assert all(type(layer.mlp) is SparseMoeBlock and layer.mlp.renormalize for layer in ours.model.layers)
    assert ours.model.layers[0].self_attn.attn.scale == 0.0625 and ours.model.embed_tokens.multiplier == 12.0
    declared = ours.fusions()
    assert DECODER_STACK not in declared and declared[LM_HEAD].logits_scale == 8.0


def test_varlen_prefill_and_decode_match_transformers(granite, ops, model_registry, paged_driver) -> None:
    check_paged_parity(granite, ops, model_registry, paged_driver, VOCAB, PROMPT_LENGTHS, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(granite, ops, model_registry, paged_driver) -> None:
    check_paged_parity(granite, ops, model_registry, paged_driver, VOCAB, None, ATOL)


def test_engine_greedy_tokens_and_logits_match_transformers(granite) -> None:
    hf_model, model_dir = granite
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in PROMPT_LENGTHS], 16, ATOL)


def test_transformers_5_names_load_the_same_model(granite, tmp_path, ops, model_registry) -> None:
    _, model_dir = granite
    stacked = build_moe_model(tmp_path, "granitemoe", seed=5, original_format=False)
    ours, _ = load_model(stacked, ops, torch.float32, "cpu", model_registry, progress=False)
    plain, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    for (name, a), (_, b) in zip(ours.state_dict().items(), plain.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(granite, options) -> None:
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=50 + n) for n in (5, 40)], granite[1], **options)


def test_int8_experts_give_the_cpu_kernel_s_and_the_reference_s_tokens(granite) -> None:
    prompts = [random_tokens(n, VOCAB, seed=40 + n) for n in (3, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "reference"):
        llm = LLM(str(granite[1]), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=128,
                  num_kv_blocks=32, quant_type="weight_only_int8")
        assert llm.engine.parts.model.model.layers[0].mlp.experts.w13_weight.dtype == torch.int8
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu"] == tokens["reference"]


def test_pre_quantized_and_bad_configs_are_refused_in_one_line() -> None:
    model_type, architecture, fields = GRANITE_MOE_PRESET
    raw = {"architectures": [architecture], "model_type": model_type, **MOE_BASE, **fields}
    for changes, fragment in (({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}},
                               "pre-quantized GraniteMoeForCausalLM checkpoints are not supported"),
                              ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
                              ({"residual_multiplier": 0}, "residual_multiplier=0 must be a finite positive number")):
        with pytest.raises(ModelLoadError) as info:
            parse_hf_config({**raw, **changes})
        assert fragment in str(info.value) and "\n" not in str(info.value)
