"""The cpu backend's fastest known read of memory laid out like its weights, for the bench's ceiling.

The bench's decode ceiling divides bytes per token by a read bandwidth probed in the same run. A
`torch.sum` over a fresh 1 GiB tensor reads 4 KiB pages, one stream per thread. The engine's
weights sit in huge pages (huge_pages.py) and its one-token fp32 products read two streams per
thread; on the team's 2-core EPYC VM that read ran 1.13-1.18x `torch.sum` (docs/benchmarks.md,
ninth session), so the engine could pass a `torch.sum` ceiling. This read is that access pattern
without the arithmetic, over a buffer placed the way place_weights places weights, switching
streams every 256 B: the fastest switch measured (twelfth session; the products switch every
128 B). The bench takes the higher of the two probes (bench/roofline.py, CPU_PLAN.fast_read).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashllm.backends.cpu import huge_pages, native


def two_stream_read(num_bytes: int) -> Callable[[], float] | None:
    """A call that reads a num_bytes buffer (rounded down to whole runs) once and returns its sum,
    holding the buffer; None where the native kernels do not run here."""
    if native.library() is None:
        return None
    floats = num_bytes // 4 // native.READ_RUN_FLOATS * native.READ_RUN_FLOATS
    if huge_pages.enabled():
        buf = huge_pages.huge_page_empty((floats,), torch.float32)
    else:
        buf = torch.empty(floats)
    buf.fill_(1.0)  # faults every page in before any timing
    total = native.read_stream(buf)
    if total != floats:  # ones sum exactly: a wrong read is caught here, not taken as a bandwidth
        raise RuntimeError(f"the native read probe summed {total} ones out of {floats}")
    return lambda: native.read_stream(buf)
