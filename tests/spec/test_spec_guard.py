"""The speculator's adaptive guard and its decode-burst allowance, driven round by round with a scripted
proposer: pauses counted in tokens and doubling, bursts of 1, 2, 4, ... steps after misses, and the threshold
a measured break-even point raises."""

from __future__ import annotations

import math

import pytest

from flashllm.config import SpeculativeConfig
from flashllm.core.block_manager import BlockManager
from flashllm.core.sampler import SamplingState
from flashllm.core.scheduler import ScheduledSequence, SchedulerOutput
from flashllm.core.sequence import Sequence
from flashllm.core.spec import speculator as spec
from flashllm.core.spec.costs import RoundCosts
from flashllm.sampling_params import SamplingParams

K = 4


class Scripted:
    """Drafts `K` tokens while `drafting` is set, nothing otherwise."""

    def __init__(self) -> None:
        self.drafting = True
        self.calls = 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self.calls += 1
        return [[7] * limit if self.drafting else [] for limit in limits]

    def forget(self, seq: Sequence) -> None:
        return None


def _setup(num_seqs: int = 1) -> tuple[spec.Speculator, Scripted, BlockManager, list[Sequence], list[SamplingState]]:
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    bm = BlockManager(num_blocks=4096, block_size=16)
    proposer = Scripted()
    speculator = spec.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=K), proposer, bm, 8192)
    seqs, states = [], []
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", [1, 2, 3], params)
        bm.allocate_prompt(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
        states.append(SamplingState.create(params, "cpu", seq.token_ids))
    return speculator, proposer, bm, seqs, states


def _round(speculator: spec.Speculator, bm: BlockManager, seqs: list[Sequence], states: list[SamplingState],
           accepted: int = 0, steps: int = 1) -> list[int]:
    """One decode round: attach drafts, then `accepted` drafts + the bonus token (or `steps` tokens of a burst
    when nothing was drafted) advance each sequence. Returns each sequence's draft count."""
    batch = SchedulerOutput([ScheduledSequence(seq, 1, True) for seq in seqs])
    speculator.attach(batch, states, token_budget=1024)
    drafts = [len(item.draft_token_ids) for item in batch.scheduled]
    emitted = [accepted + 1 if n else steps for n in drafts]
    for seq, count in zip(seqs, emitted, strict=True):
        bm.append_slots(seq, count)
        for _ in range(count):
            seq.append_token(5)
        seq.num_computed_tokens = seq.num_tokens - 1
        bm.trim(seq)
    speculator.observe(batch.scheduled, emitted)
    return drafts


def _rounds_to_pause(rate: float = 1.0) -> int:
    """Rounds of all-rejected drafts before the guard pauses: its average starts at `rate` (1 for a new
    sequence, the threshold after a pause) and keeps 1 - weight of itself each round; it must fall below
    min_acceptance after at least _MIN_ROUNDS rounds."""
    rounds = 0
    while rounds < spec._MIN_ROUNDS or rate >= spec._DEFAULT_MIN_ACCEPTANCE:
        rounds, rate = rounds + 1, rate * (1 - spec._EMA_WEIGHT)
    return rounds


def test_the_guard_pauses_for_tokens_not_rounds_and_doubles_each_pause() -> None:
    speculator, _, bm, seqs, states = _setup()
    seq = seqs[0]
    for _ in range(_rounds_to_pause()):  # every draft rejected
        assert _round(speculator, bm, seqs, states) == [K]
    paused_at = seq.num_tokens
    # a paused sequence may run long bursts; the pause ends after _FIRST_PAUSE tokens, however many rounds
    assert speculator.burst_steps(seqs) is None
    while seq.num_tokens < paused_at + spec._FIRST_PAUSE:
        assert _round(speculator, bm, seqs, states, steps=3) == [0]
    assert _round(speculator, bm, seqs, states) == [K]  # judged afresh, from the threshold
    assert _rounds_to_pause(spec._DEFAULT_MIN_ACCEPTANCE) == spec._MIN_ROUNDS < _rounds_to_pause()
    for _ in range(_rounds_to_pause(spec._DEFAULT_MIN_ACCEPTANCE) - 1):
        assert _round(speculator, bm, seqs, states) == [K]
    paused_at = seq.num_tokens
    skipped = 0
    while not _round(speculator, bm, seqs, states)[0]:
        skipped += 1
    assert skipped == 2 * spec._FIRST_PAUSE and seq.num_tokens - 1 - paused_at == skipped


def test_accepted_drafts_keep_drafting_without_a_pause() -> None:
    speculator, _, bm, seqs, states = _setup()
    for _ in range(20):
        assert _round(speculator, bm, seqs, states, accepted=2) == [K]
    assert speculator.stats.num_rounds == 20 and speculator.stats.acceptance_rate == 0.5
    assert speculator.stats.mean_accepted_length == 3.0


def test_bursts_after_misses_grow_1_2_4_then_are_unlimited_and_an_accepted_draft_resets_them() -> None:
    speculator, proposer, bm, seqs, states = _setup()
    assert speculator.burst_steps(seqs) is None  # never drafted for
    proposer.drafting = False
    allowed = []
    for _ in range(spec._MAX_MISS_SHIFT + 2):
        _round(speculator, bm, seqs, states)
        allowed.append(speculator.burst_steps(seqs))
    assert allowed == [1, 2, 4, None, None]
    proposer.drafting = True
    _round(speculator, bm, seqs, states, accepted=K)
    assert speculator.burst_steps(seqs) is None  # drafting works again: no miss to answer
    proposer.drafting = False
    _round(speculator, bm, seqs, states)
    assert speculator.burst_steps(seqs) == 1
    proposer.drafting = True
    _round(speculator, bm, seqs, states, accepted=0)  # a draft all rejected is a miss too
    assert speculator.burst_steps(seqs) == 2


def test_a_batch_bursts_as_far_as_its_most_recently_missed_sequence_allows() -> None:
    speculator, proposer, bm, seqs, states = _setup(num_seqs=3)
    proposer.drafting = False
    for _ in range(3):
        _round(speculator, bm, seqs[:1], states[:1])  # the first sequence missed three times: 4 steps
    _round(speculator, bm, seqs[1:2], states[1:2])  # the second once: 1 step; the third was never drafted for
    assert speculator.burst_steps([seqs[0], seqs[2]]) == 4
    assert speculator.burst_steps(seqs) == 1


def test_the_guard_pauses_below_a_measured_break_even_the_quarter_would_let_draft() -> None:
    """Half the drafts accepted: above the default quarter (drafting goes on), below a break-even of 0.6."""
    speculator, _, bm, seqs, states = _setup()
    for _ in range(3 * _rounds_to_pause()):
        assert _round(speculator, bm, seqs, states, accepted=K // 2) == [K]
    costly = RoundCosts(K, decode_step=10.0, decode_token=10.0, verify=14.0, draft=10.0 * (1 + 0.6 * K) - 14.0)  # break-even 0.6
    assert math.isclose(costly.break_even(), 0.6)
    speculator.set_break_even(costly)
    assert math.isclose(speculator.min_acceptance, 0.6)
    rounds = 0
    while _round(speculator, bm, seqs, states, accepted=K // 2) == [K]:
        rounds += 1
        assert rounds <= _rounds_to_pause() + spec._MIN_ROUNDS, "the guard never paused below its break-even"


@pytest.mark.parametrize("break_even, expected", [(0.05, spec._DEFAULT_MIN_ACCEPTANCE), (0.4, 0.4),
                                                  (1.7, spec._MAX_MIN_ACCEPTANCE)])
def test_the_measured_threshold_is_kept_between_the_quarter_and_the_cap(break_even: float, expected: float) -> None:
    speculator = _setup()[0]
    speculator.set_break_even(RoundCosts(K, decode_step=10.0, decode_token=10.0, verify=10.0, draft=10.0 * (1 + break_even * K) - 10.0))
    assert math.isclose(speculator.min_acceptance, expected)
