"""Decode-sized matmuls split by output rows across the CPU's cores, one torch call per core.

On `epyc3-2c` (docs/benchmarks.md; 40 distinct 4864x896 fp32 weights, so every read comes from
DRAM) F.linear of one token reads 18.5 GB/s with 1 or 2 intra-op threads alike (BLAS runs a
GEMV on one core), while two Python threads each running F.linear on half the rows read
26.6 GB/s; llama.cpp's own GEMV reaches ~33 GB/s there. torch ops
release the GIL, so a small thread pool is enough: the calling thread runs the first share
itself and waits for the others. Only calls with few tokens and a large weight split: for
larger batches BLAS already threads the GEMM, and small weights cost less than a hand-off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

# A decode batch. Up to here flashllm threads the products itself: MKL's fp32 GEMM with 2..32 rows
# reads weights at 6-8 GB/s on `epyc3-2c` (5.5 ms for 16 x 896 by 9728 against 2.5 ms for the
# native tiles of csrc/decode_kernels.c); from ~64 rows BLAS catches up.
SPLIT_MAX_TOKENS = 32
SPLIT_MIN_ELEMENTS = 1 << 20   # ~4 MB of fp32 weight: below it a hand-off (~20 us) costs more than it saves
ROW_ALIGN = 16                 # share boundaries on whole cache lines of output

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_workers_override: int | None = None  # set while torch_single_threaded() holds torch at one thread


def workers() -> int:
    """How many shares a split call makes: torch's intra-op thread count (set_num_threads honoured)."""
    return _workers_override or max(1, torch.get_num_threads())


@contextmanager
def torch_single_threaded() -> Iterator[None]:
    """Run torch's own ops on one thread while split calls keep using all the configured cores.

    torch's OpenMP workers spin for a while after every parallel region. In a decode step the
    GEMVs run on this module's threads between small torch ops (norms, rotary, attention of one
    token) that gain nothing from a second thread, so the spinning workers only steal the cores
    the GEMV threads need: on `epyc3-2c` (docs/benchmarks.md) batch-1 decode of the 0.5b shape runs
    8.1 tokens/s with torch at 2 threads and 12.0 with torch at 1 (w8a16: 15.8 -> 23.9). Not reentrant across
    threads: torch's thread count is process-wide, and the engine steps on one thread.
    """
    global _workers_override
    threads = torch.get_num_threads()
    if threads == 1 or _workers_override is not None:
        yield
        return
    _workers_override = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _workers_override = None


def should_split(num_tokens: int, out_features: int, in_features: int) -> bool:
    """Whether a (num_tokens, in_features) x (out_features, in_features).T product is worth splitting."""
    return (workers() > 1 and 0 < num_tokens <= SPLIT_MAX_TOKENS
            and out_features * in_features >= SPLIT_MIN_ELEMENTS and out_features >= 2 * ROW_ALIGN)


def row_shares(out_features: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) row ranges covering 0..out_features in `parts` nearly equal, ROW_ALIGN-aligned shares."""
    step = -(-out_features // parts)
    step = -(-step // ROW_ALIGN) * ROW_ALIGN
    return [(start, min(start + step, out_features)) for start in range(0, out_features, step)]


def _executor(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _lock:
        if _pool is None or _pool_workers < size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="flashllm-cpu-gemv")
            _pool_workers = size
        return _pool


def run_shares(out_features: int, body: Callable[[int, int], None]) -> None:
    """Call body(start, end) for each row share, the first on this thread and the rest on the pool.

    body must write only its own rows of a shared output; exceptions propagate to the caller.
    """
    shares = row_shares(out_features, workers())
    if len(shares) == 1:
        body(*shares[0])
        return
    pool = _executor(len(shares) - 1)
    # inference and grad modes are thread-local: the workers run under the caller's
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def in_callers_mode(start: int, end: int) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            body(start, end)

    futures: list[Future[None]] = [pool.submit(in_callers_mode, start, end) for start, end in shares[1:]]
    try:
        body(*shares[0])
    finally:
        for future in futures:
            future.result()


def split_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x (T, K), weight (N, K) in x.dtype, with output rows split across cores.

    Each output element is still one dot product over all of K, so the result equals the unsplit
    call up to the BLAS kernel's summation order.
    """
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)

    def body(start: int, end: int) -> None:
        out[:, start:end] = torch.nn.functional.linear(x, weight[start:end])

    run_shares(weight.shape[0], body)
    return out
