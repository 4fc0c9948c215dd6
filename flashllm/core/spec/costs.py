"""What a speculative round costs on this machine against plain decoding, measured on one sequence.

The adaptive guard (core/spec/speculator.py) stops a sequence's drafts when its acceptance falls below the
break-even point. With drafts that cost nothing to make (the n-gram lookup) that point is low and a fixed
floor serves. A draft model's drafts cost a forward pass each (an MTP layer's or EAGLE head's a pass of
that layer), and a verify step of 1 + k rows costs more than a decode step, so the break-even point depends
on the machine and the models: the engine measures it once at start-up (build.calibrate_guard,
RoundCosts.break_even), on a sequence of its own, through the same executor and proposer a round uses. The
bench reads the verify step's cost from the same measurement.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from flashllm.core.sampler import SamplingState
from flashllm.core.scheduler import ScheduledSequence, SchedulerOutput
from flashllm.core.sequence import Sequence
from flashllm.sampling_params import SamplingParams

_PROMPT_TOKENS = 128
_WARMUP = 1


@dataclass(frozen=True, slots=True)
class RoundCosts:
    """Seconds (a summary of timed repeats, see measure_round): a one-token decode step and a verify step of the
    token and `drafts` drafted tokens; with a proposer measured, also a plain decode token as the engine runs it
    (bursts of several steps where the runner has them) and the proposer's `drafts` drafts."""

    drafts: int
    decode_step: float
    verify: float
    decode_token: float | None = None
    draft: float | None = None

    @property
    def verify_step_cost(self) -> float:
        """The verify step over a one-token decode step (the bench's verify_step_cost)."""
        return self.verify / self.decode_step

    def break_even(self) -> float:
        """The acceptance (accepted / drafted) at which a round of `drafts` drafts, which yields 1 + acceptance *
        drafts tokens for draft + verify seconds, matches plain decoding's seconds per token (a proposer's
        measurement only)."""
        if self.draft is None or self.decode_token is None:
            raise ValueError("break_even needs the costs measured with a proposer")
        return ((self.draft + self.verify) / self.decode_token - 1.0) / self.drafts


def measure_round(engine: Any, drafts: int, repeats: int = 5, proposer: Any = None,
                  summary: Callable[[list[float]], float] = statistics.median) -> RoundCosts | None:
    """Time the steps of RoundCosts on a greedy sequence of its own (up to _PROMPT_TOKENS distinct prompt tokens,
    as max_model_len allows) whose blocks come from the engine's block manager and go back; with `proposer`,
    plain bursts and its measure_drafts(seq, drafts, timer) too; each the `summary` (median, or min) of its
    timed repeats. None where the free blocks or max_model_len leave no room."""
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    state = SamplingState.create(params, engine.runner.device, [])
    burst = max(1, min(engine.config.scheduler.num_scheduler_steps, engine.executor.max_tokens_per_step([state])))
    ahead = 1 + max(drafts, burst)  # positions a step writes past the prompt's last token
    length = min(_PROMPT_TOKENS, engine.parts.hf_config.vocab_size - 1, (engine.max_model_len or 2**31) - ahead)
    bm = engine.block_manager
    if length < 2 or -(-(length + ahead) // bm.block_size) > bm.num_free_blocks:
        return None
    seq = Sequence("round-costs", list(range(1, length + 1)), params)  # no token repeats: nothing to look up
    bm.allocate_prompt(seq)
    try:
        seq.num_computed_tokens = seq.num_tokens - 1  # the prompt's KV content does not change a step's cost
        bm.append_slots(seq, ahead)

        def step(draft: list[int], steps: int) -> Callable[[], object]:
            batch = SchedulerOutput([ScheduledSequence(seq, 1, True, list(draft))])
            return lambda: engine.executor.execute(batch, [state], steps)

        def timed(run: Callable[[], object]) -> float:
            return summary(_seconds(run, repeats))

        costs = RoundCosts(drafts, decode_step=timed(step([], 1)), verify=timed(step([7] * drafts, 1)))
        if proposer is None:  # the verify step's cost alone (the bench): no bursts, no drafts
            return costs
        return replace(costs, decode_token=timed(step([], burst)) / burst,
                       draft=proposer.measure_drafts(seq, drafts, timed))
    finally:
        bm.free(seq)
        if engine.speculator is not None:  # a proposer reading hidden states kept the steps' rows
            engine.speculator.forget(seq)


def _seconds(run: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of run after _WARMUP untimed ones."""
    samples = []
    for _ in range(_WARMUP + repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return samples[_WARMUP:]
