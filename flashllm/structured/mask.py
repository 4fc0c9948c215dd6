"""Per-sequence matcher state and the token mask it puts on a batch of logits."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_BITS = 32


class GrammarState:
    """Where one sequence's output stands in its grammar; the engine advances it token by token."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.failed = False  # a token the grammar refused was recorded, or a mask step ran out of budget

    def fill_bitmask(self, row: Tensor) -> None:
        """Write the allowed next tokens into row: (ceil(V / 32),) int32, contiguous, on the CPU; bit i of
        word w allows token 32 w + i."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance past the token just sampled; False (and `failed`) when the grammar does not allow it."""
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
