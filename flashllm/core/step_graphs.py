"""Decode steps replayed from device graphs (CUDA graphs on cuda), one graph per batch size.

A decode step of a small model is hundreds of short kernels: launched one by one from Python,
the host is the bottleneck (the 0.5b shape decoded ~50 tokens/s eagerly on an H100, far below
what its memory streams). A graph records the step's launches once and replays them with one
call. The recorded kernels read fixed device buffers, so `DecodeGraphs` owns those buffers:
each step copies the batch's ids, positions, slots, lengths and block tables into them (one
asynchronous copy each, from pinned host memory) and replays the graph of the smallest
captured batch size that holds the batch. Rows past the batch are padding: slot -1 (the KV
write skips it), context length 1 over block 0 (attention reads a valid block and the row is
dropped), token and position 0.

Only decode-shaped steps are captured (every sequence brings exactly one new token); prefill
and mixed steps run eagerly. The graph's attention sees block tables as wide as max_model_len,
so its split count is fixed; contexts shorter than that end their splits early.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.registry.backend import DeviceAdapter, StepGraph

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # slot_mapping entry of a padding token: write_kv_cache skips it (the op's contract)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The capture ladder: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and it)."""
    ladder = {1, 2, 4, 8, *range(16, max_num_seqs + 1, 16), max_num_seqs}
    return sorted(size for size in ladder if 1 <= size <= max_num_seqs)


class DecodeGraphs:
    """Captured decode steps of `model` over `kv_caches`, by padded batch size.

    `capture()` records one graph per size (largest first, sharing one memory pool);
    `run(input_ids, positions, slots, seq_lens, block_tables)` fills the static inputs and
    replays; it returns the (B, vocab) fp32 logits of the B real rows, a view of a buffer the
    next replay overwrites (the sampler consumes it within the step).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, ...]], adapter: DeviceAdapter,
                 device: torch.device, block_size: int, max_model_len: int, batch_sizes: Sequence[int]) -> None:
        if not batch_sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model, self.kv_caches, self.adapter, self.device = model, kv_caches, adapter, device
        self.block_size = block_size
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.batch_sizes = sorted(set(batch_sizes))
        n = self.max_batch = self.batch_sizes[-1]
        pinned = device.type != "cpu"
        # ids, positions and slots share one buffer (one copy per step); lengths and tables are int32
        self.tokens = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._host_tokens = torch.zeros((3, n), dtype=torch.int64, pin_memory=pinned)
        self._host_lens = torch.ones(n, dtype=torch.int32, pin_memory=pinned)
        self._host_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, pin_memory=pinned)
        self._np_tokens, self._np_lens, self._np_tables = (
            t.numpy() for t in (self._host_tokens, self._host_lens, self._host_tables))
        self._np_tokens[2] = PAD_SLOT
        self.tokens.copy_(self._host_tokens)
        self._copied: Any = None  # an event after the last step's host-to-device copies
        self.logits: torch.Tensor | None = None  # (max_batch, vocab) fp32, written by every graph
        self.graphs: dict[int, StepGraph] = {}

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :batch], cu_seqlens_q=self.cu_seqlens_q[: batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_seqlen_q=1, max_seqlen_k=self.max_blocks * self.block_size,
        )

    def _step(self, batch: int) -> None:
        hidden = self.model(self.tokens[0, :batch], self.tokens[1, :batch], self.kv_caches, self._metadata(batch))
        logits = self.model.compute_logits(hidden)
        if self.logits is None:  # the first (eager, largest) warm-up sizes the shared output buffer
            self.logits = torch.empty((self.max_batch, logits.shape[-1]), dtype=torch.float32, device=self.device)
        self.logits[:batch].copy_(logits)

    def capture(self) -> None:
        """Warm up and record one graph per batch size; the inputs hold padding meanwhile."""
        start = time.perf_counter()
        pool = None
        with self.adapter.inference_mode():
            for batch in reversed(self.batch_sizes):
                self._step(batch)  # eager first: compiles kernels and sizes library workspaces
                self.adapter.synchronize(self.device)
                graph = self.adapter.new_graph(self.device)
                if graph is None:
                    raise RuntimeError(f"the {self.device.type} adapter offers no graphs to capture")
                with graph.capture(pool):
                    self._step(batch)
                pool = graph.pool()
                self.graphs[batch] = graph
        self.adapter.synchronize(self.device)
        logger.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(self.graphs),
                    ", ".join(map(str, self.batch_sizes)), time.perf_counter() - start)

    def fits(self, num_seqs: int, widest_table: int) -> bool:
        """Whether a decode step of num_seqs sequences with block tables this wide has a graph."""
        return 0 < num_seqs <= self.max_batch and widest_table <= self.max_blocks and bool(self.graphs)

    def run(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Replay the step for len(input_ids) sequences with one new token each; their fp32 logits."""
        real = len(input_ids)
        batch = next(size for size in self.batch_sizes if size >= real)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        tokens, lens, tables = self._np_tokens, self._np_lens, self._np_tables
        tokens[0, :real], tokens[1, :real], tokens[2, :real] = input_ids, positions, slots
        tokens[:, real:batch] = 0
        tokens[2, real:batch] = PAD_SLOT
        lens[:real] = seq_lens
        lens[real:batch] = 1
        # entries past a table's length are never read (masked by its length): stale ids are fine
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        self.tokens.copy_(self._host_tokens, non_blocking=True)
        self.seq_lens[:batch].copy_(self._host_lens[:batch], non_blocking=True)
        self.block_tables[:batch].copy_(self._host_tables[:batch], non_blocking=True)
        self._copied = self.adapter.record_event(self.device)
        self.graphs[batch].replay()
        assert self.logits is not None
        return self.logits[:real]
