"""Tests' oracle for resident memory: the pages under tensors that the kernel backs for this process."""

from __future__ import annotations

import mmap
import struct

import torch

PAGE = mmap.PAGESIZE


def backed_pages(*tensors: torch.Tensor) -> int:
    """Bytes of the pages under the tensors that the kernel backs for this process alone (written, not
    the shared zero page a read maps; or swapped out), from /proc/self/pagemap entry by entry: the
    kernel's own accounting, read here on its own and per address, so another mapping the kernel
    merged with these (another test's cache still alive) cannot add to it. Linux only."""
    total = 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        for t in tensors:
            first, end = t.data_ptr() // PAGE, -(-(t.data_ptr() + t.nbytes) // PAGE)
            pagemap.seek(first * 8)
            for (entry,) in struct.iter_unpack("<Q", pagemap.read((end - first) * 8)):
                written = entry >> 63 & 1 and entry >> 56 & 1  # present, and mapped by this process alone
                total += PAGE if written or entry >> 62 & 1 else 0
    return total
