"""Weights in transparent huge pages: the cpu backend's `place_weights` after a model loads.

A decode step streams every weight once. With 4 KiB pages it walks a page table entry per 4 KiB,
and the hardware prefetchers stop at every page boundary. From 2 MiB pages the native one-token
product over a 544 MB fp32 weight reads 4-9% faster (18-19 -> 19-20 GB/s) and the 16-token product
runs 3-7% faster (paired runs in one process, `epyc3-2c` in docs/benchmarks.md, THP mode
"madvise").

Each float or integer weight of at least HUGE_PAGE bytes is copied into an anonymous mapping whose
2 MiB-aligned interior is advised MADV_HUGEPAGE before it is written, so the kernel backs it with
huge pages as it faults the pages in (no khugepaged wait). Tied weights stay tied: a storage is
moved once and every tensor on it follows. Where the OS has no MADV_HUGEPAGE, or with
FLASHLLM_CPU_HUGE_PAGES=0 (A/B runs), nothing moves. Results do not change: the bytes are the same.
"""

from __future__ import annotations

import math
import mmap
import os

import torch
from torch import Tensor, nn

from flashllm.ops.quant_matmul import QuantizedWeight

ENV_SWITCH = "FLASHLLM_CPU_HUGE_PAGES"
HUGE_PAGE = 2 << 20


def enabled() -> bool:
    """Whether place_weights moves anything here (the OS has MADV_HUGEPAGE and the switch is not 0)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV_SWITCH, "1") != "0"


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous CPU tensor in memory advised for 2 MiB pages (the pages are
    faulted in, huge, when first written). The tensor keeps its mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE  # page-aligned: the mapping starts on a page
    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE or HUGE_PAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)


def huge_page_copy(t: Tensor) -> Tensor:
    """A contiguous copy of the CPU tensor t in memory advised for 2 MiB pages (t itself if it is
    smaller than one page). The tensor keeps its mapping alive."""
    if t.nbytes < HUGE_PAGE:
        return t
    copy = huge_page_empty(tuple(t.shape), t.dtype)
    copy.copy_(t)
    return copy


def _movable(t: Tensor | None) -> bool:
    # only tensors that are their whole storage: moving one view of a shared storage would split it
    # from the others
    return (t is not None and t.device.type == "cpu" and t.nbytes >= HUGE_PAGE and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes)


def place_empty(model: nn.Module) -> int:
    """Before the weights load: each large parameter becomes an uninitialized tensor of its shape in
    huge pages, so loading writes the weights there and place_weights has nothing to copy (its copy
    held the largest weight twice: +0.55 GB on the 0.5b shape's peak resident memory, the tied
    embedding). Every parameter must then be loaded (the loader checks). Returns the bytes placed."""
    if not enabled():
        return 0
    placed: dict[int, Tensor] = {}  # the constructed tensor's data_ptr -> its replacement (tied ones stay one)
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if _movable(param.data):
                    key = param.data_ptr()
                    if key not in placed:
                        empty = huge_page_empty(tuple(param.shape), param.dtype)
                        placed[key] = placed[empty.data_ptr()] = empty  # a tied parameter met again after
                    param.data = placed[key]
    fresh = {t.data_ptr(): t for t in placed.values()}
    model._huge_page_ptrs = set(fresh)  # place_weights leaves these where they are
    model._huge_page_bytes = sum(t.nbytes for t in fresh.values())  # what place_weights reports beside its own
    return model._huge_page_bytes


def place_weights(model: nn.Module) -> tuple[int, int]:
    """Move model's large parameters, buffers and QuantizedWeight tensors into huge pages (those
    place_empty put there already stay); returns (bytes in huge pages in all, bytes moved now), (0, 0) when
    not enabled()."""
    if not enabled():
        return 0, 0
    moved: dict[int, Tensor] = {}  # storage data_ptr -> its copy, so tied tensors stay one
    already: set[int] = getattr(model, "_huge_page_ptrs", set())

    def place(t: Tensor | None) -> Tensor | None:
        if t is None or not _movable(t) or t.data_ptr() in already:
            return t
        key = t.data_ptr()
        if key not in moved:
            copy = huge_page_copy(t)
            moved[key] = moved[copy.data_ptr()] = copy  # a tied tensor met again after its move
        return moved[key]

    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                param.data = place(param.data)
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, place(buffer))
            for value in vars(module).values():
                if isinstance(value, QuantizedWeight):
                    placed = place(value.data), place(value.scales), place(value.zeros)
                    if any(new is not old for new, old in zip(placed, (value.data, value.scales, value.zeros), strict=True)):
                        value.data, value.scales, value.zeros = placed
                        value.kernel_cache.clear()  # re-layouts of the old storage are rebuilt on first use
    if hasattr(model, "_huge_page_ptrs"):
        del model._huge_page_ptrs
    now = sum(t.nbytes for key, t in moved.items() if key != t.data_ptr())
    return getattr(model, "_huge_page_bytes", 0) + now, now
