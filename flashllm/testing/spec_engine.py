"""Engines and prompts the speculative-decoding tests share: random prompts and a small paged cpu/reference LLM."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

BLOCK = 16


def random_prompts(count: int, seed: int, vocab_size: int = 256, max_len: int = 90) -> list[list[int]]:
    """`count` prompts of 1..max_len - 1 token ids drawn from [0, vocab_size), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randrange(1, max_len))] for _ in range(count)]


def spec_llm(model_dir: Path, backend: str, spec: Any, **kwargs: Any) -> Any:
    """An fp32 LLM over 16-token blocks (96 of them, 16 sequences, 128-token steps, 256-token context unless
    kwargs say otherwise) with the SpeculativeConfig `spec` (None: plain decoding)."""
    from flashllm.llm import LLM

    options = {"block_size": BLOCK, "num_kv_blocks": 96, "max_num_seqs": 16, "max_num_batched_tokens": 128,
               "max_model_len": 256, **kwargs}
    return LLM(str(model_dir), backend=backend, dtype="float32", speculative_config=spec, **options)


def check_parity_under_preemption(model_dir: Path, backend: str, spec: Any, count: int, blocks: int) -> Any:
    """Greedy tokens with the SpeculativeConfig `spec` equal plain decoding's for `count` random prompts plus a
    quarter of them again (prefix-cache hits) with mixed max_tokens, over `blocks` cache blocks (fewer than 96:
    preemption must happen); drafts were both accepted and rejected, and the stats say so. Returns the
    speculating LLM (AssertionError on any failure)."""
    from flashllm.sampling_params import SamplingParams

    prompts = random_prompts(count, seed=3)
    prompts += [list(p) for p in prompts[: count // 4]]  # the same prompts again: prefix-cache hits
    rng = random.Random(4)
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True) for _ in prompts]
    options = {"num_kv_blocks": blocks, "enable_prefix_caching": True}
    plain = [o.outputs[0].token_ids for o in spec_llm(model_dir, backend, None, **options).generate(
        prompts, params, use_tqdm=False)]
    llm = spec_llm(model_dir, backend, spec, **options)
    drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.speculator.stats
    assert stats.num_accepted > count // 2 and stats.num_drafted > stats.num_accepted, stats
    assert 0.0 < stats.acceptance_rate < 1.0 and stats.mean_accepted_length > 1.0
    if blocks < 96:
        assert llm.engine.scheduler.num_preemptions > 0, "the cache is meant to be too small: nothing was preempted"
    assert drafted == plain
    return llm


def record_drafts(llm: Any) -> list[tuple[list[int], int, list[int]]]:
    """A list that fills, as `llm` generates, with each proposal: (the sequence's tokens, its draft limit, the
    drafts its speculator's proposer returned)."""
    proposer = llm.engine.speculator.proposer
    calls: list[tuple[list[int], int, list[int]]] = []
    propose = proposer.propose

    def recording(seqs: list[Any], limits: list[int]) -> list[list[int]]:
        drafts = propose(seqs, limits)
        calls.extend((list(s.token_ids), n, list(d)) for s, n, d in zip(seqs, limits, drafts, strict=True))
        return drafts

    proposer.propose = recording
    return calls
