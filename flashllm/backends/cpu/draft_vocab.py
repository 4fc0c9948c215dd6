"""A drafter's greedy head over a subset of the vocabulary: the greedy screen's rows for chosen token ids only.

A draft model's tokens are guesses that the target verifies, so its greedy head need not range over the
whole vocabulary. On a copy workload the tokens worth guessing are those of the prompt and the output so
far, plus the tokens a BPE vocabulary lists first (its bytes and earliest merges, the most frequent); the
proposer (core/spec/draft_model.py) chooses them. For SmolLM2-135M the full head's int8 copy is 28 MB of
the ~83 MB an int4 draft step reads; 4096 rows of it are 2.4 MB.

GreedySubset holds the greedy screen's int8 (or bf16) codes, scales, margin bounds and fp32 rows
(greedy_screen.py) of the chosen ids, gathered once and appended to as ids are added, and the ids
themselves: the same screen and pick then give the fp32 argmax over those rows (exact over the subset, by
the screen's bound), and the pick's row index maps back to its token id (in the decode burst's C code as
well, csrc/decode_stack.c). Rows are padded to a multiple of _ROW_ALIGN with copies of the last row (a copy
maps to the same id, so it never changes the pick). A row the pick cannot settle (a non-finite score) gets
the whole vocabulary's argmax from the model's logits, as in the full screen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flashllm.backends.cpu import native
from flashllm.backends.cpu.greedy_screen import GreedyScreen

_ROW_ALIGN = 16


class GreedySubset(GreedyScreen):
    """hidden rows (T, K) fp32 -> each row's fp32 argmax token over the chosen ids' rows of `full`'s head.

    A GreedyScreen (its call, scoring, kept tensors and scratch) over the rows `choose` gathers from `full`,
    with `ids` (row -> token id, int64) set; margins and the unsure rows' fallback are `full`'s."""

    def __init__(self, full: GreedyScreen) -> None:  # the rows come from `full`, not from a weight
        self.full = full
        self.kind, self.multiplier, self.in_features = full.kind, full.multiplier, full.in_features
        self.input_format = full.input_format
        self.picked = 0
        self._count = 0  # real rows (the rest up to vocab_size are padding)
        self._chosen: list[int] = []
        self._allocate(0)
        self._kept: dict[object, Tensor] = {}

    def _allocate(self, capacity: int) -> None:
        full, k = self.full, self.in_features
        self.screen = torch.empty((capacity, k), dtype=full.screen.dtype)
        self.scales = torch.empty(capacity if full.scales.numel() else 0, dtype=torch.float32)
        self.weight = torch.empty((capacity, k), dtype=torch.float32)
        self.row_bound = torch.empty(capacity, dtype=torch.float32)
        self.ids = torch.empty(capacity, dtype=torch.int64)
        self.vocab_size = 0

    @property
    def chosen(self) -> list[int]:
        """The token ids the rows hold, in row order."""
        return list(self._chosen)

    def choose(self, ids: Sequence[int]) -> None:
        """Rows for exactly these token ids (distinct, each in 0..the head's vocab_size - 1), in this order.
        An extension of the last call's list only gathers the new rows."""
        ids = list(ids)
        if not ids:
            raise ValueError("a greedy vocabulary subset needs at least one token id")
        vocab = self.full.vocab_size
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"the subset's token ids must be distinct and in 0..{vocab - 1}")
        start = len(self._chosen) if ids[:len(self._chosen)] == self._chosen else 0
        padded = -(-len(ids) // _ROW_ALIGN) * _ROW_ALIGN
        if padded > self.ids.numel():
            old = (self.screen, self.scales, self.weight, self.row_bound, self.ids)
            self._allocate(max(padded, 2 * self.ids.numel()))
            if start:
                for new, kept in zip((self.screen, self.scales, self.weight, self.row_bound, self.ids), old,
                                     strict=True):
                    if kept.numel():
                        new[:start].copy_(kept[:start])
        rows = torch.tensor(ids[start:] + [ids[-1]] * (padded - len(ids)), dtype=torch.int64)
        part = slice(start, padded)
        full = self.full
        self.screen[part] = full.screen[rows]
        if self.scales.numel():
            self.scales[part] = full.scales[rows]
        self.weight[part] = full.weight[rows]
        self.row_bound[part] = full.row_bound[rows]
        self.ids[part] = rows
        self._chosen, self._count, self.vocab_size = ids, len(ids), padded

    def margins(self, split: bool) -> tuple[float, float, float]:
        """The full screen's margins (its floors use the largest row norm of the whole head, which bounds the
        subset's)."""
        return self.full.margins(split)

    def settle(self, x: Tensor, out: Tensor) -> None:
        """Tokens the pick left at -1: the whole vocabulary's argmax from the model's logits."""
        self.full.settle(x, out)

    def __call__(self, hidden: Tensor) -> Tensor | None:
        """(T,) int64 token ids, or None where the native screen does not take these rows (no rows chosen yet,
        or a GGUF head whose rounded input the subset was not checked for)."""
        if not self.vocab_size or self.input_format is not None:
            return None
        rows = self._rows_per_call(hidden.shape[0])
        if rows >= hidden.shape[0]:
            return super().__call__(hidden)
        # The screen takes fewer rows at once (an AVX2 CPU's bf16 screen: two, where the fp32 tiles beat it over a
        # whole head); a subset's few rows are still far cheaper to screen a few rows at a time than the head.
        parts = [super(GreedySubset, self).__call__(part) for part in hidden.split(rows)]
        return None if any(part is None for part in parts) else torch.cat(parts)  # type: ignore[arg-type]

    def _rows_per_call(self, tokens: int) -> int:
        """The most of `tokens` rows the native screen takes in one call."""
        lib = native.library()
        if self.kind != "bf16" or lib is None:
            return tokens
        return next((t for t in range(tokens, 1, -1) if lib.flashllm_bf16_screen_takes(t)), 1)
