"""The cpu backend's multi-step greedy bursts hand every step's hidden states (and an EAGLE-3 head's tapped
streams) to a drafter, as single steps do: the rows a drafter records are the same bit for bit whether the
target ran bursts or single steps, and so are an EAGLE-3 head's drafts after the guard paused its sequence
(bursts) and let it draft again; before, the head resumed with a gap in its cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.backends.cpu import native
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.eagle import build_eagle3_head
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 60, 2], [8, 9, 10, 11, 3, 3], list(range(30, 63))]
TOKENS = 60


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("burst-hidden")
    # 8 layers, so the head's default taps are three different layers; untied (see test_spec_engine.py)
    target = build_tiny_model(root / "target", "llama", seed=3, tokenizer=False, num_hidden_layers=8,
                              tie_word_embeddings=False)
    return target, build_eagle3_head(root / "head", target, seed=6, predictable=0.03)


def _llm(dirs: tuple[Path, Path], steps: int, min_acceptance: float) -> LLM:
    target, head = dirs
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "min_acceptance": min_acceptance}
    return LLM(str(target), backend="cpu", dtype="float32", block_size=16, max_model_len=256, num_kv_blocks=64,
               num_scheduler_steps=steps, speculative_config=config)


def _recorded_rows(llm: LLM) -> tuple[dict[tuple[int, int], tuple[torch.Tensor, ...]], list[int]]:
    """Run PROMPTS in one batch with a sink beside the proposer's that keeps, per (request, position), the final
    hidden row and the tapped rows; also the rows each sink call got."""
    runner = llm.engine.runner
    taps = llm.engine.parts.model.model.hidden_taps
    proposer_sink, kept, calls = runner.hidden_sink, {}, []

    def sink(inputs, hidden):
        proposer_sink(inputs, hidden)
        calls.append(hidden.shape[0])
        bounds = inputs.attn_metadata.cu_seqlens_q.tolist()
        for entry, seq_id in enumerate(inputs.seq_ids):
            for row in range(bounds[entry], bounds[entry + 1]):
                position = int(inputs.positions[row])
                kept[(seq_id, position)] = (hidden[row].clone(), *(s[row].clone() for s in taps.states))

    runner.hidden_sink = sink
    llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    order = {seq_id: i for i, seq_id in enumerate(sorted({seq_id for seq_id, _ in kept}))}  # ids go in prompt order
    return {(order[seq_id], position): rows for (seq_id, position), rows in kept.items()}, calls


def test_bursts_hand_a_drafter_the_rows_single_steps_hand_it(dirs) -> None:
    """Three sequences in one batch; the guard pauses them at once (min_acceptance 0.99 after their first rounds),
    so most of their tokens come from bursts."""
    bursts, burst_calls = _recorded_rows(_llm(dirs, 8, 0.99))
    singles, single_calls = _recorded_rows(_llm(dirs, 1, 0.99))
    assert len(burst_calls) < len(single_calls) / 2, f"few steps came in bursts: {burst_calls}"
    prompt_rows = sum(len(p) for p in PROMPTS)
    assert bursts.keys() == singles.keys()
    assert len(singles) == prompt_rows + len(PROMPTS) * (TOKENS - 1)
    for key, rows in singles.items():
        for got, want in zip(bursts[key], rows, strict=True):
            assert torch.equal(got, want), key


def _drafts(llm: LLM) -> tuple[dict[tuple[int, int], list[int]], list[list[int]]]:
    """Each round's drafts by (request, sequence length), and the requests' tokens."""
    proposer = llm.engine.speculator.proposer
    propose, drafts, current = proposer.propose, {}, {"request": 0}

    def recording(seqs, limits):
        out = propose(seqs, limits)
        for seq, draft in zip(seqs, out, strict=True):
            drafts[(current["request"], seq.num_tokens)] = list(draft)
        return out

    proposer.propose = recording
    tokens = []
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        current["request"] = i
        tokens.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    return drafts, tokens


def test_a_heads_drafts_after_a_pause_do_not_depend_on_bursts(dirs) -> None:
    """With a threshold the head's acceptance falls below now and then, sequences pause (bursts) and draft again;
    every round's drafts equal those of the same positions when every step is single."""
    burst_llm = _llm(dirs, 8, 0.6)
    bursts, burst_tokens = _drafts(burst_llm)
    singles, single_tokens = _drafts(_llm(dirs, 1, 0.6))
    stats = burst_llm.engine.speculator.stats
    assert burst_tokens == single_tokens
    assert stats.num_accepted > 0, stats
    shared = bursts.keys() & singles.keys()
    # rounds after a pause: a position some burst ran past before the round
    resumed = [k for k in shared if any(j[0] == k[0] and j[1] < k[1] and (k[0], j[1] + 1) not in bursts
                                        for j in bursts)]
    assert resumed, "no sequence drafted again after the guard paused it"
    assert {k: bursts[k] for k in shared} == {k: singles[k] for k in shared}
