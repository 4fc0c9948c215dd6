"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from flashllm.config import SCHEDULING_POLICIES, SchedulerConfig
from flashllm.core.block_manager import BlockManager
from flashllm.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: its next `num_new_tokens` uncomputed tokens.

    The step covers positions [seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens)
    (read before `Scheduler.update`). `produces_token` is True when the step reaches the sequence's
    last token, i.e. the model runner must sample one token for it. A decode may carry drafted tokens,
    whose KV slots the block table covers too; `num_new_tokens` does not count them.
    """

    seq: Sequence
    num_new_tokens: int
    produces_token: bool
    # tokens drafted to follow the sequence's last one (speculative decoding, core/spec/): the step runs
    # them after it and the runner verifies them; empty for everything else
    draft_token_ids: list[int] = field(default_factory=list)


def check_scheduler_config(config: SchedulerConfig) -> None:
    """Raise ValueError, naming the setting, for limits a scheduler cannot work with."""
    if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
        raise ValueError(
            f"max_num_seqs and max_num_batched_tokens must be >= 1, got {config.max_num_seqs} "
            f"and {config.max_num_batched_tokens}; fix SchedulerConfig"
        )
    if config.max_prefill_tokens is not None and config.max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1 or None, got {config.max_prefill_tokens}; "
                         "fix SchedulerConfig")
    if config.num_scheduler_steps < 1:
        raise ValueError(f"num_scheduler_steps must be >= 1, got {config.num_scheduler_steps}; fix SchedulerConfig")
    if config.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                         f"{config.scheduling_policy!r}; fix SchedulerConfig")


def priority_order(seq: Sequence) -> tuple[int, float, int]:
    """The scheduling_policy "priority" order of a sequence: its priority (lower first), then arrival."""
    return seq.priority, seq.arrival_time, seq.seq_id


@dataclass(slots=True)
class SchedulerOutput:
    """What one engine step runs: the sequences in batch order, and who was preempted for it."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which sequences run and how many of their tokens.

    Running sequences go first, in admission order (decodes and later prefill chunks); then waiting
    ones are admitted FIFO while seats (max_num_seqs), tokens (max_num_batched_tokens) and KV blocks
    allow. Prompt tokens (everything but decodes) share a further per-step budget, max_prefill_tokens
    when set, so a burst of new prompts is prefilled over several steps and decodes run in each.
    When a running sequence needs a block that is not there, the most recently admitted running sequence is preempted: its blocks are freed and it re-queues at the front to recompute.

    With scheduling_policy "priority" both orders are priority_order's instead of arrival's: the waiting queue
    is kept sorted by it (a preempted sequence goes back to its place), and running sequences are scheduled in
    it each step, so the lowest-priority one is the first preempted. A running sequence is never preempted to
    admit a waiting one (as in vLLM).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        check_scheduler_config(config)
        self.config = config
        self.block_manager = block_manager
        self._prefill_left = 0  # prompt tokens the step being scheduled may still take
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # distinct LoRA adapters the running batch may use at once (the device's slots); None: no LoRA
        self.max_loras: int | None = None
        self._by_priority = config.scheduling_policy == "priority"

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- requests in and out ---------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a WAITING sequence; reject prompts that could never be scheduled (ValueError)."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(
                f"only a new WAITING sequence without blocks can be added; sequence {seq.seq_id} "
                f"is {seq.status.name} with {len(seq.block_table)} blocks"
            )
        self._check_prompt_fits(seq)
        if self._by_priority:
            bisect.insort(self.waiting, seq, key=priority_order)
        else:
            self.waiting.append(seq)

    def _check_prompt_fits(self, seq: Sequence) -> None:
        cfg = self.config
        if seq.num_tokens > cfg.max_model_len:
            raise ValueError(
                f"prompt of request {seq.request_id!r} has {seq.num_tokens} tokens, more than "
                f"max_model_len={cfg.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if not cfg.enable_chunked_prefill and seq.num_tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"prompt of request {seq.request_id!r} has {seq.num_tokens} tokens, more than "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} with chunked prefill off; "
                "enable chunked prefill or raise max_num_batched_tokens"
            )
        bm = self.block_manager
        num_blocks = -(-seq.num_tokens // bm.block_size)
        if num_blocks > bm.num_total_blocks:
            raise ValueError(
                f"prompt of request {seq.request_id!r} needs {num_blocks} KV blocks of "
                f"{bm.block_size} tokens but the cache has only {bm.num_total_blocks}; "
                "give the KV cache more memory (num_kv_blocks / kv_cache_memory)"
            )

    def finish(self, seq: Sequence, reason: FinishReason | str) -> None:
        """Mark seq FINISHED with reason ("stop" / "length" / "abort"), free its blocks, dequeue it."""
        if seq.is_finished:
            return
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        if seq not in queue:
            raise ValueError(
                f"sequence {seq.seq_id} is {seq.status.name} but not in this scheduler; add it before finishing it"
            )
        queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason(reason)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of request_id with reason "abort"; returns them."""
        seqs = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)
        return seqs

    def fork(self, parent: Sequence, request_id: str | None = None) -> tuple[Sequence, list[tuple[int, int]]]:
        """Clone a RUNNING sequence into a new running one sharing its KV (beam search, n > 1).

        Returns the child and the (src_block, dst_block) KV copies to perform before the next step.
        """
        if parent.status is not SequenceStatus.RUNNING:
            raise ValueError(f"only a RUNNING sequence can be forked; sequence {parent.seq_id} is {parent.status.name}")
        child = parent.clone(request_id)
        copies = self.block_manager.fork(parent, child)
        self.running.append(child)
        return child, copies

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; never exceeds max_num_batched_tokens or max_num_seqs."""
        out = SchedulerOutput()
        cap = self.config.max_prefill_tokens
        self._prefill_left = self.config.max_num_batched_tokens if cap is None else cap
        if self._by_priority:
            self.running.sort(key=priority_order)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # blocks are short: admitting now would only preempt again
            budget = self._admit_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _chunk_size(self, num_uncomputed: int, budget: int) -> int:
        """Tokens to schedule of a sequence with num_uncomputed tokens left; 0 = not this step.

        More than one token left is prompt work (a prompt, a later chunk, a recompute): it also draws
        on the step's prefill budget, unless chunking is off and the whole prompt must run at once
        (then only the step's first prompt work may exceed that budget)."""
        if num_uncomputed > 1:
            budget = self._prefill_budget(num_uncomputed, budget)
        if num_uncomputed <= budget:
            return num_uncomputed
        # A recompute after preemption can exceed the whole budget even with chunking off;
        # splitting it is the only way it can ever run again.
        if self.config.enable_chunked_prefill or num_uncomputed > self.config.max_num_batched_tokens:
            return budget
        return 0

    def _prefill_budget(self, num_uncomputed: int, budget: int) -> int:
        """The share of budget that prompt work of num_uncomputed tokens may take in this step."""
        left = self._prefill_left
        if self.config.max_prefill_tokens is None or left >= min(num_uncomputed, budget):
            return budget
        first = left == self.config.max_prefill_tokens  # no prompt work in this step yet
        if not self.config.enable_chunked_prefill and first:
            return budget  # the cap would hold this prompt back forever; let it run alone
        return left

    def _take(self, num_uncomputed: int, num_new: int) -> None:
        """Count num_new scheduled tokens against the prefill budget when they are prompt work."""
        if num_uncomputed > 1:
            self._prefill_left -= min(num_new, self._prefill_left)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk_size(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            if not self._make_room(seq, num_new, i, out):
                continue  # seq itself was preempted; running[i] is now the next one
            self.block_manager.append_slots(seq, num_new)
            self._add_to_batch(out, seq, num_new)
            self._take(seq.num_uncomputed_tokens, num_new)
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, seq: Sequence, num_new: int, index: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of running until seq's next blocks fit; False if seq went too."""
        while not self.block_manager.can_append(seq, num_new):
            if len(self.running) > index + 1:
                self._preempt(self.running[-1], out)
            elif index > 0:
                self._preempt(seq, out)
                return False
            else:
                bm = self.block_manager
                raise RuntimeError(
                    f"sequence {seq.seq_id} of request {seq.request_id!r} needs KV blocks for "
                    f"{seq.num_computed_tokens + num_new} tokens but the whole cache holds "
                    f"{bm.num_total_blocks} blocks of {bm.block_size} tokens and nothing else is "
                    "running; give the KV cache more memory or lower max_model_len"
                )
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)  # also resets num_computed_tokens: it will recompute
        seq.status = SequenceStatus.WAITING
        if self._by_priority:
            bisect.insort(self.waiting, seq, key=priority_order)
        else:
            self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_hit = bm.num_prefix_hit_tokens(seq)
            num_new = self._chunk_size(seq.num_tokens - num_hit, budget)
            if num_new == 0 or not bm.can_allocate(seq, num_new) or not self._adapter_fits(seq):
                break  # FIFO: later requests do not overtake the head of the queue
            self.waiting.popleft()
            bm.allocate_prompt(seq)
            bm.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(out, seq, num_new)
            self._take(seq.num_tokens - num_hit, num_new)
            budget -= num_new
        return budget

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether seq's LoRA adapter is running already or a device slot is left for it."""
        if self.max_loras is None or not seq.lora_id:
            return True
        active = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in active or len(active) < self.max_loras

    @staticmethod
    def _add_to_batch(out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        produces_token = seq.num_computed_tokens + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSequence(seq, num_new, produces_token))

    def update(self, output: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """Record a finished step: advance computed tokens, cache full blocks, append samples.

        sampled_token_ids[i] belongs to output.scheduled[i]: a token id where produces_token is
        True, else None. Sequences finished meanwhile (aborted) are skipped. Returns the sequences
        that received a token; stop checks are the engine's (it calls `finish`).
        """
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(
                f"update got {len(sampled_token_ids)} sampled tokens for "
                f"{len(output.scheduled)} scheduled sequences; pass one entry (id or None) each"
            )
        updated: list[Sequence] = []
        for item, token_id in zip(output.scheduled, sampled_token_ids, strict=True):
            seq = item.seq
            if seq.is_finished:
                continue
            if (token_id is not None) != item.produces_token:
                raise ValueError(
                    f"sequence {seq.seq_id}: expected "
                    f"{'a sampled token' if item.produces_token else 'None (non-final chunk)'}, "
                    f"got {token_id!r}"
                )
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq)
            if token_id is not None:
                seq.append_token(token_id)
                updated.append(seq)
        return updated
