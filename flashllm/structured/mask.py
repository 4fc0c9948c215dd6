"""Per-sequence matcher state and the token mask it puts on a batch of logits.

The masks of a step are computed on the CPU while the device runs that step's forward pass: the
model runner calls `prefetch_masks` before the forward, a worker thread fills each grammar row's
bitmask (llguidance drops the GIL while it does), and the sampler's `apply_grammar_masks` takes the
finished rows instead of computing them after the forward.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_BITS = 32
# False computes every mask in the sampler, after the forward (the A/B baseline of benchmarks/cpu/structured_ab.py)
PREFETCH = True
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _worker() -> ThreadPoolExecutor:
    """The one thread that computes prefetched masks (one, so a matcher is never used by two threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-grammar-mask")
        return _pool


class GrammarState:
    """Where one sequence's output stands in its grammar; the engine advances it token by token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # the logits' width the masks cover
        self.failed = False  # a token the grammar refused was recorded, or a mask step ran out of budget
        # a mask being computed for the current position (prefetch_masks): the job and the row it fills
        self._pending: tuple[Future[None], Tensor] | None = None

    def compute_bitmask(self, row: Tensor) -> None:
        """Write the allowed next tokens into row: (ceil(V / 32),) int32, contiguous, on the CPU; bit i of
        word w allows token 32 w + i."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def fill_bitmask(self, row: Tensor) -> None:
        """compute_bitmask's result in row, taken from the prefetched mask when one was started."""
        pending = self._take_pending()
        if pending is not None and pending.shape == row.shape:
            row.copy_(pending)
        else:
            self.compute_bitmask(row)

    def _take_pending(self) -> Tensor | None:
        """The prefetched row once its job is done (its error raised here), or None; clears it."""
        if self._pending is None:
            return None
        job, row = self._pending
        self._pending = None
        job.result()
        return row

    def settle(self) -> None:
        """Wait for and drop a prefetched mask nobody took (its step failed), so the matcher may move on."""
        if self._pending is not None:
            self._pending[0].exception()
            self._pending = None

    def accept(self, token_id: int) -> bool:
        """Advance past the token just sampled; False (and `failed`) when the grammar does not allow it."""
        self.settle()
        if self.failed:
            return False
        if not self._matcher.consume_token(token_id):
            self.failed = True
            logger.warning("structured output: token %d is not allowed here (%s)", token_id,
                           self._matcher.get_error()[:200])
        return not self.failed

    @property
    def finished(self) -> bool:
        """True when the grammar takes no more text (the output is complete)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


def prefetch_masks(grammars: list[GrammarState | None]) -> None:
    """Start computing the next-token mask of every grammar row on the worker thread; the sampler's
    apply_grammar_masks picks the rows up. Call it before the step's forward, after the previous
    step's tokens were accepted. A no-op without grammar rows or with PREFETCH off."""
    rows = [g for g in grammars if g is not None]
    if not rows or not PREFETCH:
        return
    for grammar in rows:
        grammar.settle()
    words = (max(g.vocab_size for g in rows) + _BITS - 1) // _BITS
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)

    def fill() -> None:
        for j, grammar in enumerate(rows):
            grammar.compute_bitmask(bitmask[j])

    job = _worker().submit(fill)
    for j, grammar in enumerate(rows):
        grammar._pending = (job, bitmask[j])


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(R, W) int32 words -> (R, vocab_size) bool, True where the token is allowed."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_masks(logits: Tensor, grammars: list[GrammarState | None]) -> None:
    """In place: tokens a row's grammar does not allow get -inf. logits (B, V) fp32; grammars[i] is row i's
    state or None (unconstrained). A row whose other processing (min_tokens) had already removed every
    token its grammar allows keeps the grammar's tokens, at equal logits: the grammar wins."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    vocab_size = logits.shape[1]
    bitmask = torch.empty((len(rows), (vocab_size + _BITS - 1) // _BITS), dtype=torch.int32)
    for j, i in enumerate(rows):
        grammars[i].fill_bitmask(bitmask[j])  # type: ignore[union-attr]
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab_size)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(dim=1)
    if bool(dead.any()):
        # nothing allowed at all (a matcher in its error state): any token, and the engine ends the sequence
        masked[dead] = torch.where(allowed[dead] | ~allowed[dead].any(dim=1, keepdim=True), 0.0, float("-inf"))
    logits.index_copy_(0, index, masked)
