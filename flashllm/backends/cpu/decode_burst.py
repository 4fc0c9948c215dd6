"""The cpu backend's greedy decode bursts: several greedy decode steps of the same sequences in one
native call (flashllm_decode_burst in csrc/decode_stack.c).

Between two batch-1 decode steps the engine spends ~1.2 ms in Python (scheduling, the flat batch's
tensors, the fused step's and the greedy head's set-up, sampling bookkeeping) of a ~52-60 ms token
for the 0.5b shape (`intel-2c`, the machines of docs/benchmarks.md). Little of it is work: it runs
just after 1.6 GB of weights have streamed through the caches, so every interpreter object it
touches comes from memory.
A burst runs decode_stack.py's fused step and greedy_screen.py's screen and pick back to back in C,
feeding each step's tokens to the next, so that cost is paid once per burst instead of per token.
Each step computes what the engine's single greedy steps compute, in the same order, so the tokens
are the same (tests hold it to that).

The cpu runner (runner.py: CpuRunner.execute_burst) runs a burst only for a decode batch of plain
greedy sequences without penalties; the engine offers several steps only with nothing waiting to
join, grows each sequence's blocks to cover every step first, then records the tokens one step at a
time (so stop strings, max_tokens and the prefix cache see exactly the steps they would have) and
gives back the slots the burst did not fill. The burst itself ends after a step that
produced one of the given stop token ids, or where the pick could not settle a token from its
screen (that token then comes from its full logits, as in a single step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from flashllm.backends.cpu import decode_stack, greedy_screen, native, parallel
from flashllm.ops.attention_metadata import AttentionMetadata

_I64, _P, _D2 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double * 2


class _Head(ctypes.Structure):  # csrc/decode_stack.c's burst_head
    _fields_ = [("int8", _I64), ("copy", _P), ("scales", _P), ("N", _I64), ("multiplier", _I64), ("weight", _P),
                ("bound", _P), ("factor", _D2), ("floor0", _D2), ("floor1", _D2), ("scores", _P), ("scratch", _P),
                ("counts", _P), ("screen_threads", ctypes.c_int), ("pick_threads", ctypes.c_int), ("ids", _P)]


class GreedyBurst:
    """Callable(input_ids, positions, kv_caches, attn_metadata, steps, stop_ids) -> the tokens of up to
    `steps` greedy decode steps ([step][sequence], at least one step), or None for a batch it does not
    take (the engine then runs single steps). input_ids, positions and the metadata's slot_mapping and
    seq_lens are changed (the C code moves them on from step to step). `takes(num_seqs)` says
    beforehand whether a batch of that many sequences can run (the screen's path for that many
    tokens; an AVX2 CPU's bf16 screen takes at most 9, or 2 with its tiles switched off)."""

    def __init__(self, fused: decode_stack.FusedDecode, screen: greedy_screen.GreedyScreen) -> None:
        self.fused, self.screen = fused, screen
        plain, split = screen.margins(False), screen.margins(True)
        self._head = _Head(int8=int(screen.kind == "int8"), multiplier=screen.multiplier,
                           factor=_D2(plain[0], split[0]), floor0=_D2(plain[1], split[1]),
                           floor1=_D2(plain[2], split[2]))
        self._point_at_rows()

    def _point_at_rows(self) -> None:
        """The head's row tables: a vocabulary subset's (draft_vocab.py) may grow, and move, between calls."""
        screen, head = self.screen, self._head
        head.copy, head.scales, head.N = screen.screen.data_ptr(), screen.scales.data_ptr(), screen.vocab_size
        head.weight, head.bound = screen.weight.data_ptr(), screen.row_bound.data_ptr()
        ids = screen.ids  # row n's token id, where the rows are a subset of the vocabulary (else None)
        head.ids = None if ids is None else ids.data_ptr()

    def takes(self, num_seqs: int) -> bool:
        lib, screen = native.library(), self.screen
        if not 0 < num_seqs <= native.MAX_TOKENS:
            return False
        if screen.kind == "int8":
            return bool(lib.flashllm_i8_screen_takes(screen.in_features, screen.multiplier))
        return bool(lib.flashllm_bf16_screen_takes(num_seqs))

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                 md: AttentionMetadata, steps: int, stop_ids: Iterable[int],
                 lora_slots: Tensor | None = None, states: Tensor | None = None) -> list[list[int]] | None:
        """states: None, or a (steps, T, H) fp32 buffer for each step's final hidden states (a drafter reads
        them); the steps' tapped streams are then fused.keep_burst_taps(steps done)'s."""
        if steps < 1 or input_ids.dtype != torch.int64:
            return None
        hidden = self.fused.set_step(input_ids, positions, kv_caches, md, lora_slots, steps)
        if hidden is None:
            return None
        lib, screen, head = native.library(), self.screen, self._head
        self._point_at_rows()
        tokens = hidden.shape[0]
        # the screen's kept tensors for this token count (a single step of another count replaces them)
        scores = screen.kept_tensor("scores", (tokens, screen.vocab_size), torch.float32)
        counts = screen.kept_tensor("counts", (2,), torch.int64)
        head.scores, head.scratch, head.counts = scores.data_ptr(), screen.scratch(lib, tokens).data_ptr(), counts.data_ptr()
        head.screen_threads = native.threads_for(tokens, screen.vocab_size, screen.in_features)
        head.pick_threads = parallel.workers()
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)
        out, picked = torch.empty((steps, tokens), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        done = self.fused.burst(head, hidden, steps, stops, out, picked, states)
        if done == 0:
            return None
        screen.picked += int(picked)
        last = out[done - 1]
        if bool((last < 0).any()):
            screen.settle(hidden, last)
        return out[:done].tolist()


def build(model: Any, argmax: Callable[[Tensor], Tensor]) -> GreedyBurst | None:
    """The greedy bursts of `model`, or None where either the fused decode step or the greedy screen
    does not apply to it, or its embedding is not one the C code copies rows of."""
    fused = decode_stack.build(model)
    screen = greedy_screen.build(model, argmax) if fused is not None else None
    if fused is None or screen is None or not fused.copies_embedding:
        return None
    return GreedyBurst(fused, screen)
