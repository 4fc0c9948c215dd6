"""GLM-4-0414 (transformers' Glm4ForCausalLM): GLM's decoder with norms after attention and after the MLP, against
transformers' own class on a tiny random checkpoint: varlen prefill and decode over the paged cache, chunked prefill
beside a decode, the engine's greedy tokens and logits, two tensor-parallel ranks; no fused decode step declared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.chatglm import Glm4Block, Glm4ForCausalLM
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD
from flashllm.sampling_params import SamplingParams
from flashllm.testing.glm import SEQ, VOCAB, build_glm
from flashllm.testing.parity import (
    assert_rows_match,
    check_chunked_prefill_beside_a_decode,
    check_varlen_prefill_and_decode,
    hf_greedy,
    random_tokens,
)
from flashllm.testing.parity import record_logits as _record_logits

PROMPT_LENGTHS = (1, 7, 63, 65, 130)
STEPS = 24
ATOL = 1e-4


@pytest.fixture(scope="module")
def glm4(tmp_path_factory):
    """(transformers Glm4ForCausalLM, its directory)."""
    hf_model = build_glm(seed=11, glm4=True)
    model_dir = tmp_path_factory.mktemp("glm4")
    hf_model.save_pretrained(model_dir)
    return hf_model, model_dir


def test_varlen_prefill_and_decode_match_transformers(glm4, ops, model_registry, paged_driver):
    hf_model, model_dir = glm4
    ours, config = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert type(ours) is Glm4ForCausalLM and config.post_norms
    assert all(type(layer) is Glm4Block for layer in ours.transformer.encoder.layers)
    driver = paged_driver(ours, block_size=16, num_blocks=64, seed=3)
    prompts = [random_tokens(n, VOCAB, seed=100 + n) for n in PROMPT_LENGTHS]
    check_varlen_prefill_and_decode(driver, hf_model, prompts, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(glm4, ops, model_registry, paged_driver):
    hf_model, model_dir = glm4
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=16, num_blocks=32, seed=5)
    check_chunked_prefill_beside_a_decode(driver, hf_model, VOCAB, ATOL)


def test_the_post_norm_blocks_declare_no_fused_decode_step(glm4, ops, model_registry):
    _, model_dir = glm4
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert DECODER_STACK not in ours.fusions() and LM_HEAD in ours.fusions()


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=16, max_model_len=SEQ, num_kv_blocks=128)
    return LLM(str(model_dir), **{**options, **kw})


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_greedy_tokens_and_logits_match_transformers(tp, glm4):
    hf_model, model_dir = glm4
    llm = _llm(model_dir, tensor_parallel_size=tp)
    try:
        rows = _record_logits(llm) if tp == 1 else None
        prompts = [random_tokens(n, VOCAB, seed=n) for n in PROMPT_LENGTHS]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
        for prompt, output in zip(prompts, outputs, strict=True):
            tokens, logits = hf_greedy(hf_model, prompt, STEPS)
            assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
            if rows is not None:
                assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=ATOL)
    finally:
        llm.engine.shutdown()
