"""Per-sequence state: token ids, progress through the model, KV block table, status."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable
from typing import Any

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence: queued, holding KV blocks and stepping, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; compares equal to its plain string ("stop", "length", "abort")."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class Sequence:
    """One generation stream: the prompt plus the tokens sampled so far, and its KV bookkeeping.

    `token_ids` holds prompt + generated tokens. `num_computed_tokens` counts the leading tokens
    whose keys/values are already in the paged cache (prefix-cache hits included); the tokens after
    it still have to run through the model. `block_table[i]` is the physical KV block that holds
    positions `[i * block_size, (i + 1) * block_size)`.

    `block_table`, `num_computed_tokens`, `num_cached_tokens` and `block_hashes` are written by the
    BlockManager and the Scheduler; the engine reads them. `sampling_params` is opaque here.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: object | None = None,
        arrival_time: float | None = None,
    ) -> None:
        token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise ValueError(
                f"request {request_id!r} has an empty prompt; a sequence needs at least one "
                "prompt token (add a BOS token or some text)"
            )
        self.seq_id: int = next(_seq_ids)
        self.request_id = request_id
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens: int = len(token_ids)
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = 0
        self.block_table: list[int] = []
        # the slot of the model's recurrent-state caches this sequence holds while it has KV blocks (-1: none; only
        # models with per-sequence state, CausalLM.state_cache_shapes, get one: BlockManager(num_state_slots))
        self.state_slot: int = -1
        # Chained content hashes of the leading full blocks that are computed and in block_table;
        # owned by the BlockManager (they depend only on token_ids, so they never go stale).
        self.block_hashes: list[bytes] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.sampling_params = sampling_params
        # SamplingParams.prompt_logprobs: written by the model runner as prefill chunks run, by position
        self.prompt_logprobs: dict[int, tuple[float, list[tuple[int, float]]]] | None = None
        # SamplingParams.pooling: the pooled hidden state (fp32; for mean pooling the running sum), by the runner
        self.pooled: Any = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # the LoRA adapter the sequence runs with (0: the base model) and the prefix-cache salt that
        # keeps its KV blocks apart from other adapters' (b"": unsalted)
        self.lora_id: int = 0
        # the scheduling_policy "priority" order: lower runs first (vLLM's request priority); 0 by default
        self.priority: int = 0
        self.cache_salt: bytes = b""

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
            f"status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt tokens."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not yet in the cache: what the next steps must run through the model."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while the sequence is not in plain decode.

        That is: more than one token still to compute (a fresh prompt, a later chunk of a chunked
        prefill, or a recompute after preemption), or no output token yet (covers a one-token
        prompt, whose first step is still the prompt's prefill).
        """
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append one sampled token; its KV is computed by the next step that schedules it."""
        self.token_ids.append(int(token_id))

    def clone(self, request_id: str | None = None) -> Sequence:
        """A new sequence (fresh seq_id) with the same tokens, status and sampling params.

        KV state is not copied: the child starts with an empty block_table and
        num_computed_tokens == 0; `BlockManager.fork(parent, child)` shares or copies the blocks.
        """
        child = Sequence(
            self.request_id if request_id is None else request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.arrival_time,
        )
        child.token_ids = list(self.token_ids)
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.lora_id, child.cache_salt = self.lora_id, self.cache_salt
        return child
