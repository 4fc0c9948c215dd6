"""The engine: add_request / step / abort over the scheduler, model runner and sampler."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from flashllm.config import EngineConfig
from flashllm.core.bad_words import tokenize_bad_words
from flashllm.core.block_manager import BlockManager
from flashllm.core.builder import EngineParts
from flashllm.core.executor import Executor, make_executor
from flashllm.core.request import Request, prompt_token_ids
from flashllm.core.sampler import SamplerOutput, SamplingState
from flashllm.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from flashllm.core.sequence import FinishReason, Sequence
from flashllm.core.spec.build import calibrate_guard, check_speculative_config, make_speculator
from flashllm.core.spec.speculator import Speculator
from flashllm.outputs import RequestOutput
from flashllm.registry.plugins import FlashPlugins
from flashllm.sampling_params import MAX_PRIORITY, SamplingParams
from flashllm.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching: requests join the running batch between steps.

    `step()` runs one forward pass over what the scheduler picked (prefill chunks and decodes
    together), samples, applies stop conditions and returns the requests that progressed.
    """

    def __init__(self, config: EngineConfig, plugins: FlashPlugins | None = None) -> None:
        check_speculative_config(config)  # a bad draft count or method fails before any model loads
        self.executor: Executor = make_executor(config, plugins)
        self.parts: EngineParts = self.executor.parts
        self.config = config
        self.tokenizer = self.parts.tokenizer
        self.block_manager = BlockManager(self.parts.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching and not self.parts.num_state_slots,
                                          self.parts.num_state_slots)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.runner = self.executor.runner  # the driver rank's
        self.speculator: Speculator | None = make_speculator(config, self.parts.drafter, self.parts.runner,
                                                                 self.block_manager)
        calibrate_guard(self)  # a draft model's break-even acceptance on this machine
        if getattr(self.runner, "lora", None) is not None:  # multi-LoRA: a batch uses at most max_loras adapters
            self.scheduler.max_loras = config.lora.max_loras
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._ids = itertools.count()
        # structured output: constraints compiled once each (llguidance, on first use)
        self.grammars = GrammarCompiler(self.tokenizer, self.parts.eos_token_ids, self.parts.hf_config.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(self.config.model.max_model_len or 0)

    def default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the model's generation_config.json."""
        return SamplingParams.from_generation_config(self.parts.generation_config)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Validation happens here.

        lora_request: a flashllm.lora LoRARequest to run the request with that adapter (the engine
        must be built with enable_lora); the adapter is read and checked here on first use.
        priority: with scheduling_policy "priority", lower runs first (admitted first, preempted last)."""
        params = params or self.default_sampling_params()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_priority(priority)
        text, token_ids = prompt_token_ids(prompt, params, self.tokenizer)
        self._check_prompt(token_ids)
        bad_words = tokenize_bad_words(params.bad_words, self.tokenizer)
        outside = params.token_ids_outside(self.parts.hf_config.vocab_size)
        if outside:
            raise ValueError(f"logit_bias / allowed_token_ids name token ids {outside} outside the vocabulary "
                             f"[0, {self.parts.hf_config.vocab_size})")
        spec = params.structured_output
        salt = self._lora_salt(lora_request) + self._rope_salt(len(token_ids))
        request = Request(request_id, text, token_ids, params, self.tokenizer, self.parts.eos_token_ids,
                          self.runner.device, self.grammars.compile(spec) if spec is not None else None, bad_words)
        for seq in request.seqs:
            if lora_request is not None:
                seq.lora_id = lora_request.lora_int_id
            seq.cache_salt = salt
            seq.priority = priority
            self.scheduler.add(seq)
            self._by_seq[seq.seq_id] = request
        self.requests[request_id] = request
        return request_id

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r:.40}")
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (serve --scheduling-policy "
                             "priority); with first-come-first-served scheduling leave it 0")

    def add_lora(self, lora_request: Any, pinned: bool = False) -> None:
        """Register an adapter now (read and checked; LoRAError / ValueError when it cannot be used).
        pinned: its host copy is never dropped (the server's --lora-modules)."""
        manager = getattr(self.runner, "lora", None)
        if manager is None:
            raise ValueError("loading a LoRA adapter needs an engine started with enable_lora=True (--enable-lora)")
        manager.add(lora_request, pinned=pinned)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter and free its device slot; ValueError while unfinished requests use it."""
        manager = getattr(self.runner, "lora", None)
        users = sum(s.lora_id == lora_int_id for s in (*self.scheduler.waiting, *self.scheduler.running))
        if users:
            raise ValueError(f"the adapter is in use by {users} unfinished sequence(s); unload it when they finish")
        return manager is not None and manager.remove(lora_int_id)

    def _rope_salt(self, num_prompt_tokens: int) -> bytes:
        """What keys this prompt's prefix-cache blocks beside its tokens on the model's side (models/base.py
        prefix_cache_salt: QWen's dynamic NTK rotates keys by a base its prompt length picks)."""
        salt = getattr(self.parts.model, "prefix_cache_salt", None)
        return salt(num_prompt_tokens) if salt is not None else b""

    def _lora_salt(self, lora_request: Any) -> bytes:
        if lora_request is None:
            return b""
        manager = getattr(self.runner, "lora", None)
        if manager is None:
            raise ValueError("a LoRA request needs an engine started with enable_lora=True (serve: --enable-lora)")
        return manager.add(lora_request)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.parts.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks return to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.abort(request_id)
        self._forget(request)
        for seq in request.seqs:
            request.finish(seq, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduling round: schedule, run the batch on the executor, record the new tokens.

        The executor returns k >= 1 new positions per sampling sequence (several where the runner
        ran several decode steps in one call); they are recorded one position at a time, exactly
        as single steps would have been (stop tokens and strings, max_tokens, the prefix cache),
        and the KV slots a sequence did not use are given back."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampling = [item.seq for item in batch.scheduled if item.produces_token]
        states = [self._by_seq[seq.seq_id].sampling_state(seq) for seq in sampling]
        drafted = self._draft(batch, states)
        max_steps = 1 if drafted else self._max_steps(batch, states, sampling)
        if max_steps > 1:
            for item in batch.scheduled:
                self.block_manager.append_slots(item.seq, max_steps)
        positions = self.executor.execute(batch, states, max_steps)
        if self.speculator is not None:  # a draft model's prompt pass, timed with the prefill it mirrors
            self.speculator.prefill(batch)
        touched: dict[str, Request] = {}
        if not positions:  # nothing sampled: prefill chunks only
            self._record(batch, sampling, None, [None] * len(batch.scheduled), touched)
        for index, sampled in enumerate(positions):
            tokens = iter(sampled.token_ids)
            token_ids = [next(tokens) if item.produces_token else None for item in batch.scheduled]
            if index == 0:
                self._record(batch, sampling, sampled, token_ids, touched)
            else:  # a later position: only the sequences that got a token there advance
                self._record_later(batch, sampling, sampled, token_ids, touched)
        if drafted:
            self._observe_drafts(batch, positions)
        if max_steps > 1 or drafted:
            for item in batch.scheduled:
                if not item.seq.is_finished:
                    self.block_manager.trim(item.seq)
        self._release_kv()
        return [self._emit(request) for request in touched.values()]

    def _release_kv(self) -> None:
        """Hand the runner the free blocks whose KV memory may go back to the OS, where its cache
        memory follows use (the cpu runner's): those without a prefix-cache hash after every step;
        once no request is left, also cached ones beyond one max_model_len sequence's worth."""
        if not getattr(self.runner, "releases_kv_memory", False):
            return  # a cache allocated whole (accelerators) keeps its blocks and its prefix cache as before
        bm = self.block_manager
        retain = None if self.scheduler.has_unfinished() else -(-self.max_model_len // bm.block_size)
        block_ids = bm.take_released(retain)
        if block_ids:
            self.runner.release_kv_blocks(block_ids)

    def _draft(self, batch: SchedulerOutput, states: list[SamplingState]) -> int:
        """Speculative decoding: drafts for this round's decodes (core/spec/speculator.py); how many."""
        if self.speculator is None:
            return 0
        budget = self.config.scheduler.max_num_batched_tokens - batch.num_batched_tokens
        return self.speculator.attach(batch, states, budget)

    def _observe_drafts(self, batch: SchedulerOutput, positions: list[SamplerOutput]) -> None:
        items = [item for item in batch.scheduled if item.produces_token]
        emitted = [sum(1 for sampled in positions if sampled.token_ids[row] is not None) for row in range(len(items))]
        self.speculator.observe(items, emitted)

    def _record_later(self, batch: SchedulerOutput, sampling: list[Sequence], sampled: SamplerOutput,
                      token_ids: list[int | None], touched: dict[str, Request]) -> None:
        """A position after the first of a multi-position round: each sequence with a token there
        advances by one (its previous token's KV was computed in this round), the others are skipped."""
        present = [(item, token) for item, token in zip(batch.scheduled, token_ids, strict=True) if token is not None]
        sub = SchedulerOutput([ScheduledSequence(item.seq, 1, True) for item, _ in present])
        self._record(sub, sampling, sampled, [token for _, token in present], touched)

    def _record(self, batch: SchedulerOutput, sampling: list[Sequence], sampled: SamplerOutput | None,
                token_ids: list[int | None], touched: dict[str, Request]) -> None:
        """Apply one position's tokens: the scheduler's update, then each sampling sequence's stop
        checks (a sequence that finished at an earlier position, or got no token here, takes none);
        its request goes into touched."""
        self.scheduler.update(batch, token_ids)
        now = time.monotonic()
        for row, seq in enumerate(sampling):
            if seq.is_finished or (sampled is not None and sampled.token_ids[row] is None):
                continue
            request = self._by_seq[seq.seq_id]
            reason = request.on_token(seq, sampled, row, now, self.max_model_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            touched[request.request_id] = request

    def _max_steps(self, batch: SchedulerOutput, states: list[SamplingState], sampling: list[Sequence]) -> int:
        """How many new positions per sequence this round may return (1: a single step).

        Several only for a decode batch (every sequence one token, all sampling) while nothing
        waits to join or every seat is taken (a seat frees when a sequence stops, and a multi-step
        round ends where any sequence reaches a stop token or its max_tokens), at most
        num_scheduler_steps and what the executor's runner takes for these states, no more than
        any sequence may still take (max_tokens, max_model_len), and where the blocks all its
        positions need are free, and what speculation allows sequences that may have a draft again soon."""
        config, scheduler = self.config.scheduler, self.scheduler
        steps = config.num_scheduler_steps
        if self.speculator is not None:
            steps = min(steps, self.speculator.burst_steps(sampling) or steps)
        if (steps < 2 or (scheduler.num_waiting and scheduler.num_running < config.max_num_seqs) or batch.preempted
                or len(states) != len(batch.scheduled)
                or any(item.num_new_tokens != 1 for item in batch.scheduled)):
            return 1
        steps = min(steps, self.executor.max_tokens_per_step(states))
        for item, state in zip(batch.scheduled, states, strict=True):
            steps = min(steps, self.max_model_len - item.seq.num_tokens)
            if state.params.max_tokens is not None:
                steps = min(steps, state.params.max_tokens - len(state.output_token_ids))
        bm = self.block_manager
        if steps > 1 and sum(bm.num_missing_blocks(item.seq, steps) for item in batch.scheduled) > bm.num_free_blocks:
            return 1
        return max(steps, 1)

    def _emit(self, request: Request) -> RequestOutput:
        output = request.output()
        if output.finished:
            self.requests.pop(request.request_id, None)
            self._forget(request)
        return output

    def _forget(self, request: Request) -> None:
        for seq in request.seqs:
            self._by_seq.pop(seq.seq_id, None)
            if self.speculator is not None:
                self.speculator.forget(seq)

    def run_until_done(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestOutput]:
        """Step until every request (or the given ones) finishes; their final outputs by id."""
        wanted = set(request_ids) if request_ids is not None else set(self.requests)
        final: dict[str, RequestOutput] = {}
        while wanted - set(final) and self.has_unfinished():
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    final[output.request_id] = output
        return final

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def check_health(self) -> None:
        """Raise DistributedError if the executor lost a rank (tensor parallelism): the engine cannot step
        any more. Call it while idle, from the thread that steps: it runs the executor's heartbeat, a
        liveness round with the ranks when they have been quiet for FLASHLLM_DIST_HEARTBEAT_S, which
        notices a rank that hangs (Executor.heartbeat)."""
        self.executor.check_health()
        self.executor.heartbeat()

    def shutdown(self) -> None:
        """Stop the executor's other ranks (tensor parallelism); the engine cannot step afterwards."""
        self.executor.shutdown()
