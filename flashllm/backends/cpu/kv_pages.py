"""The cpu backend's KV cache in lazily backed pages: resident memory follows the blocks written.

A CPU KV cache sized up front with torch.zeros is resident from the start: on the 0.5b shape in
fp32 a one-prompt run held 1.1 GB of zeroed cache beside 1.98 GB of weights. Here each cache
tensor is an anonymous private mapping left untouched, so the kernel backs a page only when a KV
write first reaches it (unwritten pages read as zeros, what torch.zeros gave). When the engine
hands blocks back (BlockManager.take_released), `release` advises MADV_DONTNEED on the whole pages
inside them: the pages leave the process at once and read as zeros again if a later sequence
reuses the block (which writes its KV before reading it, like any reused block).

MADV_FREE was the other candidate: cheaper to reuse, but the pages stay counted as resident until
the system runs short, so a server's memory would not visibly return. Huge pages are advised off
(MADV_NOHUGEPAGE) so that a release of a few blocks is not held back by a 2 MiB page around it,
and the cache is left out of core dumps (MADV_DONTDUMP: the requests' KV has no place in a crash
report). resident_bytes reads the kernel's page table entries of the caches' own addresses: the
kernel may merge adjacent mappings of the same flags (another engine's cache) into one, whose
smaps Rss would count both.
Off Linux, or with FLASHLLM_CPU_LAZY_KV=0 (A/B runs), the cache is torch.zeros as before and
nothing is released.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

ENV_SWITCH = "FLASHLLM_CPU_LAZY_KV"
PAGE = mmap.PAGESIZE


def enabled() -> bool:
    """Whether KV caches are lazily backed and released here (Linux, and the switch is not 0)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED") and os.environ.get(ENV_SWITCH, "1") != "0"


def block_runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated block ids as maximal [start, end) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for block_id in sorted(set(block_ids)):
        if runs and runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], block_id + 1)
        else:
            runs.append((block_id, block_id + 1))
    return runs


def inner_pages(start: int, end: int) -> tuple[int, int]:
    """The whole pages inside the byte range [start, end) as (offset, length); length 0 if none.

    Rounded inward: a page that also holds bytes of a block still in use is never dropped."""
    first = -(-start // PAGE) * PAGE
    last = end // PAGE * PAGE
    return first, max(last - first, 0)


class KVPages:
    """Owns the lazily backed mappings of one runner's KV caches and hands pages of freed blocks back.

    `zeros` is the cache factory ModelRunner's allocate_kv_caches calls for every (num_blocks,
    block_size, ...) cache tensor; every tensor it makes has blocks along dim 0."""

    def __init__(self) -> None:
        self.lazy = enabled()
        self._tensors: list[tuple[mmap.mmap, Tensor]] = []

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        """A zero-reading cache tensor of `shape` and `dtype`, its pages backed only once written
        (torch.zeros where not enabled or off the CPU). The tensor keeps its mapping alive."""
        if not self.lazy or torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for advice in ("MADV_NOHUGEPAGE", "MADV_DONTDUMP"):
            if hasattr(mmap, advice):
                mapping.madvise(getattr(mmap, advice))
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        self._tensors.append((mapping, tensor))
        return tensor

    def release(self, block_ids: Iterable[int]) -> int:
        """Hand the whole pages inside `block_ids`' bytes of every cache tensor back to the OS; their
        content reads as zeros afterwards. The blocks must be free. Returns the bytes advised."""
        if not self._tensors:
            return 0
        runs = block_runs(block_ids)
        advised = 0
        for mapping, tensor in self._tensors:
            block_bytes = tensor.stride(0) * tensor.element_size()
            for start, end in runs:
                offset, length = inner_pages(start * block_bytes, end * block_bytes)
                if length:
                    mapping.madvise(mmap.MADV_DONTNEED, offset, length)
                    advised += length
        return advised

    def resident_bytes(self) -> int:
        """Bytes of the lazily backed caches now in memory: their pages the kernel has backed for this
        process alone (/proc/self/pagemap, page by page over the caches' own addresses, so memory the
        kernel merged into the same mapping is not counted), swapped-out ones included. A page only
        read maps the shared zero page and is not counted, nor is one still shared with a forked
        child. 0 where none is lazy."""
        return sum(backed_bytes(t.data_ptr(), t.nbytes) for _, t in self._tensors)


_PRESENT, _SWAPPED, _EXCLUSIVE = 1 << 63, 1 << 62, 1 << 56  # /proc/pid/pagemap entry bits (kernel docs)


def backed_bytes(address: int, nbytes: int) -> int:
    """Bytes of the pages overlapping [address, address + nbytes) that this process alone has backed
    (written anonymous pages, in memory or swapped out), from /proc/self/pagemap's 64-bit entry a page."""
    first, end = address // PAGE, -(-(address + nbytes) // PAGE)
    if end <= first:
        return 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((end - first) * 8), dtype=np.uint64)
    present = (entries & np.uint64(_PRESENT | _EXCLUSIVE)) == np.uint64(_PRESENT | _EXCLUSIVE)
    swapped = (entries & np.uint64(_SWAPPED)) != 0
    return int(np.count_nonzero(present | swapped)) * PAGE
