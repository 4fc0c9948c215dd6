"""A model wrapper that gives a hand-driven paged forward (tests/models/conftest.py's PagedDriver) the recurrent-state
slots the engine's runner would: one slot of each state tensor per sequence, after the attention caches."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from flashllm.ops.attention_metadata import AttentionMetadata


class WithStateSlots:
    """Wraps a CausalLM with recurrent layers (state_cache_shapes) for a driver that knows only paged KV.

    Each sequence's slot is the first physical block of its block table (unique while the sequence lives, as the
    driver never frees blocks), so `num_slots` must be at least the driver's block count. The states start
    NaN-filled: a fresh sequence that read its slot instead of starting from zeros would poison its logits.
    """

    def __init__(self, model: Any, num_slots: int) -> None:
        self.model = model
        self.kv_caches_per_layer = getattr(model, "kv_caches_per_layer", 2)
        self.states = [tuple(torch.full((num_slots, *shape), float("nan"), dtype=dtype) for shape, dtype in layer)
                       for layer in model.state_cache_shapes()]

    def kv_cache_shape(self) -> tuple[int, int, int]:
        return self.model.kv_cache_shape()

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                 attn_metadata: AttentionMetadata) -> Tensor:
        slots = attn_metadata.block_tables[:, 0].to(torch.int64)
        md = dataclasses.replace(attn_metadata, state_slots=slots)
        return self.model(input_ids, positions, list(kv_caches) + self.states, md)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.model.compute_logits(hidden)


def recurrent_llm(path: Any, **options: Any) -> Any:
    """An LLM over the float32 checkpoint at `path` on the cpu backend, 16-token blocks, max_model_len 256 (`options`
    override any)."""
    from flashllm.llm import LLM

    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "block_size": 16, "max_model_len": 256, **options})


def check_states_across_prefill_chunks(path: Any, hf_model: torch.nn.Module, vocab_size: int) -> None:
    """Prompts prefilled 8 tokens a step (one of 30 tokens crosses several chunks, one is a single token) give
    transformers' greedy tokens and logits: each chunk continues the states the previous one left."""
    from flashllm.testing.parity import check_engine_greedy_against, random_tokens

    llm = recurrent_llm(path, enable_chunked_prefill=True, max_num_batched_tokens=8, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, vocab_size, seed=n) for n in (30, 13, 1)], steps=6)


def check_fresh_sequences_in_reused_slots(path: Any, hf_model: torch.nn.Module, vocab_size: int) -> None:
    """Three seats: three prompts of different lengths run together, then two one-token prompts take their slots
    (stale states a fresh sequence must not read) in a step of one token each (the vectorized decode path); all give
    transformers' greedy tokens, and every block is free afterwards."""
    from flashllm.testing.parity import check_engine_greedy_against, random_tokens

    llm = recurrent_llm(path, num_kv_blocks=64, max_num_seqs=3)
    prompts = [random_tokens(n, vocab_size, seed=10 + n) for n in (17, 5, 33, 1, 1)]
    check_engine_greedy_against(llm, hf_model, prompts, steps=6)
    assert llm.engine.num_free_blocks() == llm.engine.block_manager.num_total_blocks


def check_preemption_recomputes_states(path: Any, hf_model: torch.nn.Module, vocab_size: int) -> None:
    """8 blocks of 16 tokens: four prompts of 2 blocks each are admitted together and cannot all grow into a third,
    so some are preempted and recomputed from scratch; the greedy tokens stay transformers'."""
    from flashllm.testing.parity import check_engine_greedy_against, random_tokens

    llm = recurrent_llm(path, num_kv_blocks=8, max_model_len=128)
    prompts = [random_tokens(n, vocab_size, seed=20 + n) for n in (30, 31, 29, 32)]
    check_engine_greedy_against(llm, hf_model, prompts, steps=10)
    assert llm.engine.scheduler.num_preemptions > 0


def check_bfloat16_follows_transformers(path: Any, vocab_size: int) -> None:
    """bfloat16 weights prefilled 8 tokens a step: each greedy token is the argmax of transformers' bfloat16 logits
    over the same context (its own full forward), so the states' float32 recurrence and the conv states' model dtype
    keep the engine on transformers' path."""
    from transformers import AutoModelForCausalLM

    from flashllm.sampling_params import SamplingParams
    from flashllm.testing.parity import hf_logits, random_tokens

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = recurrent_llm(path, dtype="bfloat16", num_kv_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=8)
    prompts = [random_tokens(n, vocab_size, seed=n) for n in (30, 13, 1)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        logits = hf_logits(hf_model, prompt + tokens)
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens, f"prompt of {len(prompt)} tokens diverged"
