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
        # a speculative round's masks after each prefix of its drafts (prefetch_masks): job, drafts, rows
        self._pending_drafts: tuple[Future[None], list[int], Tensor] | None = None

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
        if self._pending_drafts is not None:
            self._pending_drafts[0].exception()
            self._pending_drafts = None

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` (a speculative round's drafts) the grammar allows from here."""
        self.settle()
        if self.failed or not tokens:
            return 0
        return int(self._matcher.validate_tokens(tokens))

    def compute_draft_bitmasks(self, drafts: list[int], rows: Tensor) -> None:
        """rows[j] = compute_bitmask's row after drafts[:j] were generated, for j = 0..len(drafts) (rows:
        (len(drafts) + 1, W)); the matcher is left where it was. The drafts must be a valid prefix."""
        consumed = 0
        try:
            for j, token in enumerate(drafts):
                self.compute_bitmask(rows[j])
                if not self._matcher.consume_token(token):
                    raise ValueError(f"structured output: draft token {token} is not allowed after {j} drafts")
                consumed += 1
            self.compute_bitmask(rows[len(drafts)])
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    def after(self, drafts: list[int]) -> DraftRow:
        """The grammar as a verify row sees it: after `drafts` (a valid prefix) were generated."""
        return DraftRow(self, drafts)

    def fill_draft_bitmask(self, drafts: list[int], row: Tensor) -> None:
        """compute_bitmask's row after `drafts`, from the prefetched round's masks where they hold it."""
        pending = self._pending_drafts
        if pending is not None:
            job, prefetched, rows = pending
            job.result()
            if prefetched[:len(drafts)] == drafts and len(drafts) < rows.shape[0] and rows.shape[1] == row.shape[0]:
                row.copy_(rows[len(drafts)])
                return
        self.settle()
        scratch = torch.empty((len(drafts) + 1, row.shape[0]), dtype=torch.int32)
        self.compute_draft_bitmasks(drafts, scratch)
        row.copy_(scratch[len(drafts)])

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


class DraftRow:
    """A grammar as row j of a speculative round sees it, after the round's first j drafts; it stands in for
    the GrammarState in that row's SamplingState, and the engine only ever advances the state itself."""

    __slots__ = ("drafts", "grammar")

    def __init__(self, grammar: GrammarState, drafts: list[int]) -> None:
        self.grammar = grammar
        self.drafts = drafts

    def fill_bitmask(self, row: Tensor) -> None:
        self.grammar.fill_draft_bitmask(self.drafts, row)


def prefetch_masks(grammars: list[GrammarState | None], drafts: list[list[int]] | None = None) -> None:
    """Start computing the next-token mask of every grammar row on the worker thread; the sampler's
    apply_grammar_masks picks the rows up. With `drafts` (grammars[i]'s speculative drafts, possibly none)
    a drafted row's masks after each prefix of its drafts are computed too, for the verify rows. Call it
    before the step's forward, after the previous step's tokens were accepted. A no-op without grammar rows
    or with PREFETCH off."""
    drafts = drafts or [[] for _ in grammars]
    rows = [(g, d) for g, d in zip(grammars, drafts, strict=True) if g is not None]
    if not rows or not PREFETCH:
        return
    for grammar, _ in rows:
        grammar.settle()
    words = (max(g.vocab_size for g, _ in rows) + _BITS - 1) // _BITS
    bitmasks = [torch.empty((len(d) + 1, words), dtype=torch.int32) for _, d in rows]

    def fill() -> None:
        for (grammar, draft), bitmask in zip(rows, bitmasks, strict=True):
            grammar.compute_draft_bitmasks(draft, bitmask)

    job = _worker().submit(fill)
    for (grammar, draft), bitmask in zip(rows, bitmasks, strict=True):
        grammar._pending = (job, bitmask[0])
        if draft:
            grammar._pending_drafts = (job, list(draft), bitmask)


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
