"""The machine's limits, measured in the same run: memory bandwidth and matmul FLOP/s."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Roofline:
    """Measured limits.

    bandwidth: bytes/s a read-only stream reaches (what a decode step does with the weights);
    copy_bandwidth: bytes read + written per second by a large copy.
    """

    bandwidth: float
    copy_bandwidth: float
    matmul_flops: float  # FLOP/s in `dtype`
    dtype: str

    def decode_ceiling(self, batch: int, weight_bytes: int, kv_bytes_per_step: int = 0) -> float:
        """tokens/s at batch B if every step reads all weights (and the KV of the batch) once."""
        return batch * self.bandwidth / (weight_bytes + kv_bytes_per_step)

    def compute_ceiling(self, flops_per_token: float) -> float:
        """tokens/s if matmuls ran at the measured peak."""
        return self.matmul_flops / flops_per_token


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, repeats: int, device: str = "cpu") -> float:
    fn()  # warm up: page faults, allocator, thread pool, library handles
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)  # a GPU launch returns before the work is done
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Copy a buffer of `num_bytes` (far larger than any cache): (read + written bytes) / time."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), repeats, device)
    return 2 * num_bytes / seconds


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Sum a buffer of `num_bytes`: a read-only stream, like a GEMV reading weights."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    seconds = _best_time(lambda: src.sum(), repeats, device)
    return num_bytes / seconds


def measure_matmul(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of an n x n x n GEMM in `dtype`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_time(lambda: torch.mm(a, b), repeats, device)
    return 2 * n**3 / seconds


def measure(dtype: torch.dtype = torch.float32, device: str = "cpu") -> Roofline:
    """Read and copy bandwidth and GEMM FLOP/s of `device`, measured now.

    On a GPU the decode ceiling uses the copy bandwidth (bytes read + written by a 2 GiB copy:
    BENCHMARKS.md's definition) and the matmul is 8192^3 on random data in `dtype`; on the CPU
    it uses a read-only stream, which is what a CPU decode step does with its weights.
    """
    if torch.device(device).type == "cuda":
        copy = measure_bandwidth(2 << 30, repeats=10, device=device)
        return Roofline(copy, copy, measure_matmul(dtype, n=8192, repeats=10, device=device),
                        str(dtype).removeprefix("torch."))
    return Roofline(measure_read_bandwidth(device=device), measure_bandwidth(device=device),
                    measure_matmul(dtype, device=device), str(dtype).removeprefix("torch."))
