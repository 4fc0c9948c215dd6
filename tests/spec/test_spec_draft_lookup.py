"""A draft model's lookup passes (--speculative_draft_lookup): the draft checks guesses at its next tokens as extra
one-token rows of one pass. Its drafts stay the draft's own greedy chain, round by round, whatever the guesses
(right, wrong mid-run or absent), the tokens stay plain decoding's, and right guesses save draft passes."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from flashllm.cli.spec_flags import add_speculative_flags, speculative_config
from flashllm.core.spec.draft_model import DraftModelProposer
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

_PROPOSE, _ROWS = DraftModelProposer.propose, DraftModelProposer._rows  # before any test patches them
OPTIONS = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 2, "max_model_len": 256, "dtype": "float32"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3, tokenizer=False)


class _Oracle:
    """Guesses a sequence's next tokens from plain decoding's finished sequences (the target is its own draft here,
    so they are mostly the draft's chain); every third guess has its second token wrong, so runs also break
    mid-pass; a context no finished sequence starts with gets no guess."""

    def __init__(self, finished: list[list[int]]) -> None:
        self.finished = finished
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        for full in self.finished:
            if full[:len(token_ids)] == token_ids:
                guess = full[len(token_ids):len(token_ids) + k]
                if self.calls % 3 == 0 and len(guess) > 1:
                    guess[1] = (guess[1] + 1) % 256
                return guess
        return []


def _run(target: Path, prompts: list[list[int]], lookup: _Oracle | None, monkeypatch: pytest.MonkeyPatch):
    """Tokens, every round's (sequence tokens, drafts) and the draft runner's forward calls, with this lookup."""
    rounds: list[tuple[list[int], list[int]]] = []

    def recording(self, seqs, limits):
        drafts = _PROPOSE(self, seqs, limits)
        rounds.extend((list(seq.token_ids), list(d)) for seq, d in zip(seqs, drafts, strict=True))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    # a given guard threshold: the engine measures no round at start-up, so the counters see the requests only
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 6, "min_acceptance": 0.25}
    llm = LLM(str(target), backend="cpu", speculative_config=config, **OPTIONS)
    proposer = llm.engine.speculator.proposer
    proposer.lookup = lookup
    calls = []
    runner = proposer.runner
    execute_model, execute = runner.execute_model, runner.execute
    monkeypatch.setattr(runner, "execute_model", lambda *a, **k: calls.append(1) or execute_model(*a, **k))
    monkeypatch.setattr(runner, "execute", lambda *a, **k: calls.append(1) or execute(*a, **k))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, rounds, len(calls)


def test_lookup_passes_draft_the_draft_models_own_chain_in_fewer_passes(target: Path, monkeypatch) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 50))] for _ in range(4)]
    plain = LLM(str(target), backend="cpu", **OPTIONS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    plain_tokens = [o.outputs[0].token_ids for o in plain]
    finished = [p + t for p, t in zip(prompts, plain_tokens, strict=True)]

    without, rounds_without, passes_without = _run(target, prompts, None, monkeypatch)
    oracle = _Oracle(finished)
    took: list[tuple[int, int]] = []  # (guesses, run length) of every pass with guesses

    def recording(self, views, guesses):
        runs = _ROWS(self, views, guesses)
        took.extend((len(g), len(r)) for g, r in zip(guesses, runs, strict=True) if g)
        return runs

    monkeypatch.setattr(DraftModelProposer, "_rows", recording)
    with_lookup, rounds_with, passes_with = _run(target, prompts, oracle, monkeypatch)

    assert without == plain_tokens and with_lookup == plain_tokens
    assert rounds_with == rounds_without, "the lookup changed a round's drafts"
    assert any(length >= 3 for _, length in took), f"no pass drafted three or more tokens from guesses: {took}"
    assert any(length <= guesses for guesses, length in took), f"no guessed run broke mid-pass: {took}"
    assert passes_with < passes_without, (passes_with, passes_without)


def test_a_lookup_that_guesses_nothing_leaves_the_native_bursts(target: Path, monkeypatch) -> None:
    """Without guesses the draft's steps after its catch-up still run as one multi-step call."""
    from flashllm.backends.cpu.runner import CpuRunner

    steps: list[int] = []
    execute_burst = CpuRunner.execute_burst

    def counting(self, batch, states, count):
        out = execute_burst(self, batch, states, count)
        if out is not None:
            steps.append(len(out))
        return out

    monkeypatch.setattr(CpuRunner, "execute_burst", counting)
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(30)]]
    tokens, rounds, _ = _run(target, prompts, _Oracle([]), monkeypatch)
    assert rounds and max(steps) == 5, steps  # k = 6: the catch-up pass drafts one, a burst the other five


def test_the_lookup_flag_parses_and_is_checked(target: Path) -> None:
    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)
    args = parser.parse_args(["--speculative-model", "DIR", "--speculative_draft_lookup", "0"])
    assert speculative_config(args)["draft_lookup"] is False
    assert speculative_config(parser.parse_args(["--speculative-model", "D", "--speculative-draft-lookup", "on"]))[
        "draft_lookup"] is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-model", "DIR", "--speculative_draft_lookup", "maybe"])
    with pytest.raises(ValueError, match="--speculative_draft_lookup") as info:
        LLM(str(target), backend="cpu", speculative_config={"model": str(target), "draft_lookup": "yes"}, **OPTIONS)
    assert "\n" not in str(info.value)
    llm = LLM(str(target), backend="cpu", speculative_config={"model": str(target), "draft_lookup": False}, **OPTIONS)
    assert llm.engine.speculator.proposer.lookup is None
