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

from flashllm.backends.cpu import native, parallel
from flashllm.backends.cpu.greedy_screen import GreedyScreen

_ROW_ALIGN = 16


class GreedySubset:
    """hidden rows (T, K) fp32 -> each row's fp32 argmax token over the chosen ids' rows of `full`'s head.

    Carries what GreedyBurst (decode_burst.py) reads of a GreedyScreen: kind, screen (codes), scales,
    vocab_size (the padded row count), multiplier, weight, row_bound, in_features, margins, kept_tensor,
    scratch, settle, picked, and `ids` (row -> token id, int64)."""

    def __init__(self, full: GreedyScreen) -> None:
        self.full = full
        self.kind, self.multiplier, self.in_features = full.kind, full.multiplier, full.in_features
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

    def kept_tensor(self, key: object, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        kept = self._kept.get(key)
        if kept is None or kept.shape != shape:
            kept = self._kept[key] = torch.empty(shape, dtype=dtype)
        return kept

    def scratch(self, lib, tokens: int) -> Tensor:
        return self.full.scratch(lib, tokens)  # the kernels' scratch depends on the tokens and features only

    def settle(self, x: Tensor, out: Tensor) -> None:
        """Tokens the pick left at -1: the whole vocabulary's argmax from the model's logits."""
        self.full.settle(x, out)

    def __call__(self, hidden: Tensor) -> Tensor | None:
        """(T,) int64 token ids, or None where the native screen does not take these rows."""
        lib = native.library()
        tokens, k = hidden.shape
        if (lib is None or not self.vocab_size or hidden.dtype != torch.float32
                or not 0 < tokens <= native.MAX_TOKENS or self.full.input_format is not None):
            return None
        x = hidden.contiguous()
        n = self.vocab_size
        scores = self.kept_tensor("scores", (tokens, n), torch.float32)
        scratch = self.scratch(lib, tokens)
        threads = native.threads_for(tokens, n, k)
        if self.kind == "int8":
            path = lib.flashllm_i8_screen_mt(x.data_ptr(), tokens, k, self.screen.data_ptr(), self.scales.data_ptr(),
                                             scores.data_ptr(), n, n, self.multiplier, scratch.data_ptr(), threads)
        else:
            path = lib.flashllm_bf16_gemv_mt(x.data_ptr(), self.screen.data_ptr(), scores.data_ptr(), tokens, k, n, n,
                                             scratch.data_ptr(), threads)
        if not path:
            return None
        factor, floor0, floor1 = self.margins(path == 2 and self.kind == "bf16")
        out, counts = torch.empty(tokens, dtype=torch.int64), self.kept_tensor("counts", (2,), torch.int64)
        lib.flashllm_screen_pick(x.data_ptr(), tokens, k, self.weight.data_ptr(), scores.data_ptr(), n, n,
                                 self.row_bound.data_ptr(), factor, floor0, floor1, out.data_ptr(), counts.data_ptr(),
                                 parallel.workers())
        picked, unsure = counts.tolist()
        self.picked += picked
        sure = out >= 0
        out[sure] = self.ids[out[sure]]
        if unsure:
            self.settle(x, out)
        return out
