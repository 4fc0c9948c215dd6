"""The cpu backend's fastest known reads of memory laid out like its weights, for the bench's ceiling.

The bench's decode ceiling divides bytes per token by a read bandwidth probed in the same run. A
`torch.sum` over a fresh 1 GiB tensor reads 4 KiB pages, one stream per thread. The engine's
weights sit in huge pages (huge_pages.py) and its one-token fp32 products read several rows, so
several streams, per thread at once: two where the CPU lacks AVX-512 (on `epyc3-2c`, the machines
of docs/benchmarks.md, that read runs 1.13-1.18x `torch.sum`), eight where it has it (`intel-2c`).
These reads are those access patterns without the arithmetic, over a buffer placed the way
place_weights places weights, each in the fastest form on the machine where it matters: two
streams switching every 256 B (`epyc3-2c`; the products switch every 128 B) and eight switching
every 128 B (`intel-2c`: ~1.05x the eight-row product loop's read there, ~1.2x the two-stream read).
The bench takes the highest of all its probes on whatever CPU it runs (bench/roofline.py,
CPU_PLAN.fast_read), so a pattern that is slow on one CPU costs the ceiling nothing there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from flashllm.backends.cpu import huge_pages, native

# name: (streams per thread, floats read from one stream before the next)
PATTERNS = {"two_stream_read": (2, 64), "eight_stream_read": (8, 32)}


def stream_reads(num_bytes: int) -> dict[str, Callable[[], float]]:
    """Calls that each read one num_bytes buffer (rounded down to whole runs) once, in one of
    PATTERNS, and return its sum, holding the buffer; none where the native kernels do not run here."""
    if native.library() is None:
        return {}
    floats = num_bytes // 4 // native.READ_RUN_FLOATS * native.READ_RUN_FLOATS
    if huge_pages.enabled():
        buf = huge_pages.huge_page_empty((floats,), torch.float32)
    else:
        buf = torch.empty(floats)
    buf.fill_(1.0)  # faults every page in before any timing
    reads = {name: functools.partial(native.read_stream, buf, *pattern) for name, pattern in PATTERNS.items()}
    for name, read in reads.items():
        total = read()
        if total != floats:  # ones sum exactly: a wrong read is caught here, not taken as a bandwidth
            raise RuntimeError(f"the native read probe {name} summed {total} ones out of {floats}")
    return reads
