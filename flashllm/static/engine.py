"""StaticEngine: add_request / step / abort over an exported graph, one left-padded batch at a time."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashllm.core.bad_words import tokenize_bad_words
from flashllm.core.request import Request, prompt_token_ids
from flashllm.core.sampler import Sampler
from flashllm.core.sequence import FinishReason
from flashllm.core.sequence import Sequence as Seq
from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.static.graph import KVCache, StaticGraph

# Left padding slots hold this id; the attention mask hides them, so any valid id works.
PAD_TOKEN_ID = 0

Row = tuple[Request, Seq]


@dataclass
class _Batch:
    """The running batch: its rows, the (B, S) attention mask over the cache, and the cache."""

    rows: list[Row]
    attention_mask: np.ndarray
    cache: KVCache


class StaticEngine:
    """The dynamic Engine's add_request / step / abort / has_unfinished over a StaticGraph.

    No continuous batching: when nothing runs, step() takes up to `max_num_seqs` waiting sequences
    in arrival order, left-pads them into one prefill, and later steps decode that batch one token
    at a time; sequences that arrive meanwhile wait until the whole batch has finished (joining
    would mean re-padding every running row's cache). Rows that finish or are aborted leave the
    batch. Sampling, stop rules, detokenization and outputs are the dynamic engine's (core.request).
    """

    def __init__(self, graph: StaticGraph, tokenizer: Any, eos_token_ids: list[int], max_model_len: int,
                 max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.graph = graph
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = graph.manifest.vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._waiting: deque[Row] = deque()
        self._batch: _Batch | None = None
        self._ids = itertools.count()

    @property
    def num_running(self) -> int:
        return len(self._batch.rows) if self._batch is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def batch_width(self) -> int:
        """Positions the running batch's cache spans (its longest row plus left padding); 0 when idle."""
        return self._batch.attention_mask.shape[1] if self._batch is not None else 0

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id. Raises ValueError for what cannot run."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.use_beam_search:
            raise ValueError("beam search is not available in static mode; use --mode dynamic")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available in static mode; use --mode dynamic")
        if params.structured_output is not None:
            raise ValueError("structured output is not available in static mode; use --mode dynamic")
        text, ids = prompt_token_ids(prompt, params, self.tokenizer)
        if not ids or any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"the prompt must be 1 or more token ids in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        request = Request(request_id, text, ids, params, self.tokenizer, self.eos_token_ids, torch.device("cpu"),
                          bad_words_token_ids=tokenize_bad_words(params.bad_words, self.tokenizer))
        self.requests[request_id] = request
        self._waiting.extend((request, seq) for seq in request.seqs)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now: its waiting sequences are dropped, its running rows leave the batch."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self._waiting = deque(row for row in self._waiting if row[0] is not request)
        if self._batch is not None:
            self._keep([i for i, (r, _) in enumerate(self._batch.rows) if r is not request])
        for seq in request.seqs:
            request.finish(seq, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self._batch is not None

    def step(self) -> list[RequestOutput]:
        """Prefill a new batch (when none runs) or decode one token for every row of the running one.

        Returns the outputs of the requests that got a token, as Engine.step does.
        """
        if self._batch is None:
            if not self._waiting:
                return []
            rows = [self._waiting.popleft() for _ in range(min(self.max_num_seqs, len(self._waiting)))]
            input_ids, position_ids, mask = _left_padded(rows)
            cache = self.graph.empty_cache(len(rows))
        else:
            rows, cache = self._batch.rows, self._batch.cache
            mask = np.concatenate([self._batch.attention_mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            input_ids = np.array([[seq.last_token_id] for _, seq in rows], dtype=np.int64)
            position_ids = np.array([[seq.num_tokens - 1] for _, seq in rows], dtype=np.int64)
        logits, cache = self.graph.run(input_ids, position_ids, mask, cache)
        self._batch = _Batch(rows, mask, cache)
        keep, touched = self._sample(rows, logits)
        self._keep(keep)
        return [self._emit(request) for request in touched.values()]

    def _sample(self, rows: list[Row], logits: np.ndarray) -> tuple[list[int], dict[str, Request]]:
        """Sample a token per row and record it; (indices of rows still running, requests that progressed)."""
        states = [request.sampling_state(seq) for request, seq in rows]
        sampled = self.sampler(torch.from_numpy(np.ascontiguousarray(logits)), states)
        now = time.monotonic()
        keep: list[int] = []
        touched: dict[str, Request] = {}
        for row, ((request, seq), token) in enumerate(zip(rows, sampled.token_ids, strict=True)):
            seq.append_token(token)
            if request.on_token(seq, sampled, row, now, self.max_model_len) is None:
                keep.append(row)
            touched[request.request_id] = request
        return keep, touched

    def _keep(self, keep: list[int]) -> None:
        """Shrink the running batch to rows `keep`, dropping mask columns that only padded the others."""
        batch = self._batch
        if batch is None or len(keep) == len(batch.rows):
            return
        if not keep:
            self._batch = None
            return
        mask = batch.attention_mask[keep]
        start = int(np.argmax(mask.any(axis=0)))  # the first position any remaining row uses
        cache = self.graph.select(batch.cache, keep, start)
        self._batch = _Batch([batch.rows[i] for i in keep], np.ascontiguousarray(mask[:, start:]), cache)

    def _emit(self, request: Request) -> RequestOutput:
        output = request.output()
        if output.finished:
            self.requests.pop(request.request_id, None)
        return output


def _left_padded(rows: list[Row]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, position_ids and attention_mask (B, T) of the rows' tokens, right-aligned."""
    lengths = [seq.num_tokens for _, seq in rows]
    width = max(lengths)
    input_ids = np.full((len(rows), width), PAD_TOKEN_ID, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, (_, seq) in enumerate(rows):
        input_ids[i, width - lengths[i]:] = seq.token_ids
        mask[i, width - lengths[i]:] = 1
    position_ids = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return input_ids, position_ids, mask
