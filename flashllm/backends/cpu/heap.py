"""Freed activation memory kept in the process: the cpu backend's allocator setting.

torch takes every CPU tensor from the C library's malloc. glibc serves a request above its mmap
threshold (128 KiB, adapting up to 32 MiB) with a fresh mapping and unmaps it on free, and it trims
the heap's free top back to the OS; either way the next step's tensor of that size faults its
pages in again, 4 KiB at a time, each zeroed by the kernel. A prefill step of the 0.5b shape
allocates its gate_up product (1092 tokens x 9728 features, 42 MB) in every layer, and a decode
step its logits (16 x 151936, 9.7 MB): one offline run of docs/benchmarks.md's CPU workload faults
~700,000 pages (2.8 GB) that way. In a VM a fault costs microseconds.

keep_freed_memory() tells glibc to serve every request from its heap (M_MMAP_MAX 0) and to keep
the heap's free top (M_TRIM_THRESHOLD at its largest), so a step's tensors reuse the pages earlier
steps freed: the same run faults 30,000-47,000 pages the first time and under 10 in each run after,
in 0.86x the time (medians of 8 runs with it and 14 without, alternating processes, `intel-2c` in
docs/benchmarks.md). It also gives threads started later the main heap (M_ARENA_MAX 1): glibc
would give each its own heaps and unmap them as they empty, and the server steps its engine in
such a thread (a run there faults ~520,000 pages without this, 5,600 in its second run with it).
A thread that already has its own heap keeps it.

The cost is the one of any caching allocator: the process keeps its largest steps' activations
mapped, and the OS counts them as used (a second engine in the same process sizes a CPU KV cache
from less free memory). torch asks for 64-byte-aligned blocks, slightly more than a freed block of
the same size holds, so the heap grows by a few blocks before its free ones merge: a loop of 64 MiB
tensors reuses memory from its 2nd to 7th tensor on in the main thread, from its 9th in a later
thread. The offline run ends at 6.12 GB resident against 5.89 GB without (peak 6.06 GB).

The setting is process-wide; the cpu adapter applies it once a model's weights are placed
(core/builder.py), so loading's one-off buffers come and go as before. FLASHLLM_CPU_KEEP_HEAP=0
leaves malloc as it is (A/B runs); off glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable
from functools import cache

ENV_SWITCH = "FLASHLLM_CPU_KEEP_HEAP"
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, ~2 GiB of free top kept


def is_glibc() -> bool:
    """Whether this process runs on glibc, whose mallopt the setting uses."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None off glibc."""
    fn = getattr(ctypes.CDLL(None), "mallopt", None) if is_glibc() else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc malloc_trim(0): the free top and whole free
    pages inside it); what loading freed would otherwise stay resident once keep_freed_memory() keeps
    the heap. Returns whether anything was released (False off glibc)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if is_glibc() else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


@cache  # once per process (a racing second call would set the same values again)
def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse; returns whether the setting is in effect
    (False where switched off by ENV_SWITCH=0, off glibc, or refused)."""
    mallopt = _mallopt() if os.environ.get(ENV_SWITCH, "1") != "0" else None
    # mallopt returns 1 on success (glibc refuses none of these values)
    ok = mallopt is not None and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return ok and mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_ARENA_MAX, 1) == 1
