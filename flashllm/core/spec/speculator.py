"""The engine's side of speculative decoding: which decodes get drafts, how many, and the adaptive guard."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flashllm.config import MAX_DRAFT_TOKENS, SpeculativeConfig
from flashllm.core.block_manager import BlockManager
from flashllm.core.sampler import SamplingState
from flashllm.core.scheduler import ScheduledSequence, SchedulerOutput
from flashllm.core.sequence import Sequence
from flashllm.core.spec.costs import RoundCosts
from flashllm.core.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)

# The guard's memory: each round's acceptance enters an exponential average with this weight.
_EMA_WEIGHT = 0.3
# The guard's threshold when SpeculativeConfig.min_acceptance is None: this share of the drafts, or where higher
# the measured break-even acceptance of drafts that cost passes (draft model, MTP layer, EAGLE head;
# set_break_even), never more than the cap, so a paused sequence still tries again now and then.
_DEFAULT_MIN_ACCEPTANCE, _MAX_MIN_ACCEPTANCE = 0.25, 0.9
# A sequence is judged only after this many verified rounds with drafts.
_MIN_ROUNDS = 3
# Paused sequences try again after this many tokens, doubling each time up to the cap (tokens, not rounds:
# a round without drafts may decode several).
_FIRST_PAUSE, _MAX_PAUSE = 8, 512
# After rounds without an accepted draft token (none proposed, or all rejected), a sequence still drafting
# runs multi-step decode bursts of 1, 2, 4, ... steps, up to this: a copy resumes a token or two after a
# miss, and a burst would decode past it, while text with nothing to copy soon runs at full bursts again.
_MAX_MISS_SHIFT = 3


class Proposer(Protocol):
    """Drafts tokens for decode sequences. `propose` gets the sequences and how many drafts each may
    take (>= 1); it returns one list per sequence, at most that long (empty: no guess)."""

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...

    def forget(self, seq: Sequence) -> None: ...

    def kv_cache_bytes(self) -> int: ...


@dataclass(slots=True)
class Target:
    """What a drafter is loaded beside: the target model as core/builder.py has it before the KV cache is sized."""

    config: Any            # EngineConfig
    selection: Any         # DeviceSelection
    ops: Any               # the target's OpTable
    model: Any             # the loaded target CausalLM
    hf_config: Any         # its HFModelConfig
    tokenizer: Any         # None off rank 0 or for a model without one
    model_dir: Path
    # (embedding, LM head) for a head that shares the target's, where not model's own: whole copies on the
    # driver of a target split over tensor-parallel ranks (models/layers/embedding.py gather_whole_vocabulary)
    vocabulary: Any = None


class Drafter(Protocol):
    """A proposer's weights, loaded before the target's KV cache is sized (so its cache is inside the budget).

    kv_bytes_per_block: bytes the proposer's own cache takes per target KV block (0: none); the builder sizes
    num_blocks so that num_blocks * (target's + this) fits the budget. proposer(runner, num_blocks) then
    allocates that cache and returns the Proposer (runner: the target's, whose hidden states it may read)."""

    kv_bytes_per_block: int

    def proposer(self, runner: Any, num_blocks: int) -> Proposer: ...


@dataclass(slots=True)
class _Guard:
    """One sequence's recent acceptance and whether it is pausing its drafts."""

    rate: float = 1.0
    rounds: int = 0
    resume_at: int = 0     # no drafts while the sequence is shorter than this
    pause: int = _FIRST_PAUSE
    misses: int = 0        # rounds in a row without an accepted draft token


@dataclass(slots=True)
class SpecStats:
    """Totals since start: verified rounds, drafted and accepted tokens, and tokens emitted by rounds."""

    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any draft)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence got per verified round with drafts, the bonus token included (1.0 = no gain)."""
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0


class Speculator:
    """Attaches drafts to the decodes of a scheduled batch and learns from what the runner accepted.

    A decode (one new token, sampling) is drafted for when its sequence is not paused by the guard,
    up to num_speculative_tokens, never more than its max_tokens and max_model_len leave room for
    after the bonus token, the step's unused token budget, and the KV blocks that are free (drafts
    never preempt anyone).
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, block_manager: BlockManager,
                 max_model_len: int, bursts_feed_drafter: bool = False) -> None:
        """bursts_feed_drafter: the runner's multi-step calls hand each step's hidden states to a proposer that
        reads them (ModelRunner.bursts_feed_hidden_sink), so its sequences may run them too."""
        if not 1 <= config.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculate_max_draft_token_num must be in 1..{MAX_DRAFT_TOKENS}, "
                             f"got {config.num_speculative_tokens}")
        if config.min_acceptance is not None and not 0.0 <= config.min_acceptance < 1.0:
            raise ValueError(f"the speculation guard's min_acceptance must be in [0, 1), got {config.min_acceptance}")
        self.config = config
        # the guard's threshold: the configured one, else the default until set_break_even raises it
        self.min_acceptance = _DEFAULT_MIN_ACCEPTANCE if config.min_acceptance is None else config.min_acceptance
        self.proposer = proposer
        self.single_steps = getattr(proposer, "reads_hidden_states", False) and not bursts_feed_drafter
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._guards: dict[int, _Guard] = {}

    def attach(self, batch: SchedulerOutput, states: list[SamplingState], token_budget: int) -> int:
        """Set draft_token_ids on the batch's eligible decodes (states: the sampling sequences', in batch
        order) and grow their block tables to cover the drafts; returns how many tokens were drafted.

        Each candidate's block table grows for its whole allowance before the proposer runs (a draft model
        writes its KV there); what the drafts did not use goes back at once."""
        candidates: list[ScheduledSequence] = []
        grammars: list[Any] = []
        limits: list[int] = []
        sampling = (item for item in batch.scheduled if item.produces_token)
        for item, state in zip(sampling, states, strict=True):
            limit = min(self._limit(item, state), token_budget)
            while limit > 0 and not self.block_manager.can_append(item.seq, 1 + limit):
                limit -= 1
            if limit > 0:
                self.block_manager.append_slots(item.seq, 1 + limit)
                candidates.append(item)
                grammars.append(state.grammar)
                limits.append(limit)
                token_budget -= limit
        if not candidates:
            return 0
        drafts = self.proposer.propose([item.seq for item in candidates], limits)
        total = 0
        for item, draft, limit, grammar in zip(candidates, drafts, limits, grammars, strict=True):
            draft = list(draft[:limit])
            if grammar is not None:  # structured output: drafts the grammar refuses could never be kept
                draft = draft[:grammar.valid_prefix(draft)]
            if not draft:
                self._guards[item.seq.seq_id].misses += 1
            item.draft_token_ids = draft
            total += len(item.draft_token_ids)
            if len(item.draft_token_ids) < limit:
                self.block_manager.trim(item.seq, item.seq.num_tokens + len(item.draft_token_ids))
        return total

    def prefill(self, batch: SchedulerOutput) -> None:
        """After the runner ran the batch, before its tokens are recorded: a proposer with a model of its own
        (the draft model) runs the batch's prefill chunks too, so its prompt pass is part of the prefill step
        (time to first token) rather than of the sequence's first drafted round. Sequences that can never
        be drafted for (max_tokens <= 1) are left out."""
        prefill = getattr(self.proposer, "prefill", None)
        if prefill is None:
            return
        items = [item for item in batch.scheduled if (item.num_new_tokens > 1 or not item.produces_token)
                 and not item.draft_token_ids and _may_draft(item.seq.sampling_params)]
        if items:
            prefill([item.seq for item in items], [item.seq.num_computed_tokens + item.num_new_tokens for item in items])

    def burst_steps(self, seqs: list[Sequence]) -> int | None:
        """The most decode steps a round without drafts should run for these sequences (None: no limit).

        A sequence whose last `misses` rounds brought no accepted draft token gets 2 ** (misses - 1) steps,
        no limit past 2 ** _MAX_MISS_SHIFT; one the guard pauses, or one never drafted for, sets no limit.
        With a proposer that reads the target's hidden states (MTP, EAGLE) on a runner whose bursts do not hand
        them over, a sequence still drafting allows one step, or the head's cache would miss those positions;
        one the guard pauses bursts freely there, and when it drafts again its head resumes with that gap
        (worse drafts for a while, never other tokens). The cpu runner's bursts hand them over."""
        steps: int | None = None
        for seq in seqs:
            guard = self._guards.get(seq.seq_id)
            if guard is None or seq.num_tokens < guard.resume_at:
                continue
            if self.single_steps:
                return 1
            if not 0 < guard.misses <= _MAX_MISS_SHIFT:
                continue
            allowed = 1 << (guard.misses - 1)
            steps = allowed if steps is None else min(steps, allowed)
        return steps

    def _limit(self, item: ScheduledSequence, state: SamplingState) -> int:
        seq = item.seq
        if item.num_new_tokens != 1 or seq.is_finished:
            return 0
        guard = self._guards.setdefault(seq.seq_id, _Guard())
        if seq.num_tokens < guard.resume_at:
            return 0
        limit = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if state.params.max_tokens is not None:
            limit = min(limit, state.params.max_tokens - len(state.output_token_ids) - 1)
        return max(limit, 0)

    def observe(self, items: list[ScheduledSequence], emitted: list[int]) -> None:
        """After a round: items are the sampling sequences (batch order), emitted[i] how many tokens the
        i-th got (accepted drafts + 1). Updates the totals and each drafted sequence's guard."""
        min_acceptance = self.min_acceptance
        for item, count in zip(items, emitted, strict=True):
            drafted = len(item.draft_token_ids)
            if not drafted:
                continue
            accepted = max(count - 1, 0)
            guard = self._guards.get(item.seq.seq_id)
            if guard is not None:
                guard.misses = 0 if accepted else guard.misses + 1
            stats = self.stats
            stats.num_rounds += 1
            stats.num_drafted += drafted
            stats.num_accepted += accepted
            stats.num_emitted += count
            if guard is None or min_acceptance <= 0:
                continue
            guard.rate += _EMA_WEIGHT * (accepted / drafted - guard.rate)
            guard.rounds += 1
            if guard.rounds >= _MIN_ROUNDS and guard.rate < min_acceptance:
                # below break-even: stop drafting for a while, then judge afresh from the threshold (not from
                # the full trust a new sequence starts with), so a sequence that still misses pauses again
                # after _MIN_ROUNDS rounds instead of twice as many
                guard.resume_at = item.seq.num_tokens + guard.pause
                guard.pause = min(2 * guard.pause, _MAX_PAUSE)
                guard.rate, guard.rounds = min_acceptance, 0

    def set_break_even(self, costs: RoundCosts) -> None:
        """Judge acceptance against the break-even point of these measured costs (a proposer whose drafts cost
        time: a draft model, an MTP layer, an EAGLE head), unless SpeculativeConfig.min_acceptance was given."""
        if self.config.min_acceptance is not None:
            return
        self.min_acceptance = min(max(_DEFAULT_MIN_ACCEPTANCE, costs.break_even()), _MAX_MIN_ACCEPTANCE)
        logger.info("speculation guard: %d drafts cost %.1f ms, the verify step %.1f ms, a plain token %.1f ms: "
                    "drafting pauses below %.2f acceptance", costs.drafts, costs.draft * 1e3, costs.verify * 1e3,
                    costs.decode_token * 1e3, self.min_acceptance)

    def forget(self, seq: Sequence) -> None:
        """A sequence finished: drop its guard and whatever the proposer keeps for it."""
        self._guards.pop(seq.seq_id, None)
        self.proposer.forget(seq)


def _may_draft(params: Any) -> bool:
    """Whether a sequence with these SamplingParams may ever get drafts (Speculator._limit's lasting reasons)."""
    return params is None or params.max_tokens is None or params.max_tokens > 1


class NgramDrafts:
    """The n-gram lookup as a Proposer (it keeps nothing per sequence)."""

    def __init__(self, max_ngram_size: int, min_ngram_size: int) -> None:
        self._lookup = NgramProposer(max_ngram_size, min_ngram_size)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self._lookup.propose(seq.token_ids, limit) for seq, limit in zip(seqs, limits, strict=True)]

    def forget(self, seq: Sequence) -> None:
        return None

    def kv_cache_bytes(self) -> int:
        return 0
