"""The machine's limits, measured in the same run: memory bandwidth and matmul FLOP/s."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import NamedTuple

import torch


@dataclass(frozen=True, slots=True)
class Roofline:
    """Measured limits of one device.

    read_bandwidth: bytes/s a read-only stream reaches (a reduction over a large buffer);
    copy_bandwidth: bytes read + written per second by a large copy (the GPU ceiling of
    docs/benchmarks.md); ceiling: which of the two the decode ceiling divides by ("read stream" | "copy").
    """

    read_bandwidth: float
    copy_bandwidth: float
    matmul_flops: float  # FLOP/s in `dtype`
    dtype: str
    ceiling: str
    read_probes: tuple[tuple[str, float], ...] = ()  # each read probe's bytes/s; read_bandwidth is the highest

    @property
    def bandwidth(self) -> float:
        """Bytes/s the decode ceiling assumes a step streams its weights at."""
        return self.read_bandwidth if self.ceiling == "read stream" else self.copy_bandwidth

    def decode_ceiling(self, batch: int, weight_bytes: int, kv_bytes_per_step: int = 0) -> float:
        """tokens/s at batch B if every step reads all weights (and the KV of the batch) once."""
        return batch * self.bandwidth / (weight_bytes + kv_bytes_per_step)

    def compute_ceiling(self, flops_per_token: float) -> float:
        """tokens/s if matmuls ran at the measured peak."""
        return self.matmul_flops / flops_per_token


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes and repeats of one device type's measurements, and the bandwidth its decode ceiling uses.

    calls_per_timing: calls between two clock reads, so that one synchronize's cost (tens of us
    on a GPU) is small beside a ~1 ms copy; the time per call is the best timing / calls.
    """

    copy_bytes: int
    read_bytes: int
    matmul_n: int
    repeats: int
    calls_per_timing: int
    ceiling: str
    bracket_runs: bool = False  # probe the ceiling's bandwidth before and after each timed run (bench/repeats.py)
    # "module:function" of the device backend's own read probes: function(num_bytes) -> {name: a call
    # that reads that many bytes once}, empty where they cannot run; the read bandwidth is the highest
    # of them and the torch reduction
    fast_read: str | None = None
    # reads a held read-stream probe times back to back (held_ceiling_probe): its ceiling is the
    # fastest of them, its sustained rate their bytes over their whole time; 0: `repeats` reads, and
    # the sustained rate is the ceiling
    sustained_reads: int = 0


# The CPU keeps its read-stream convention: a CPU decode step is a GEMV streaming its weights,
# and a CPU copy's write-allocate traffic makes "read + written" understate what a read reaches.
# Every other device uses docs/benchmarks.md's definition, a 2 GiB device copy counted as bytes
# read + written, and an 8192^3 GEMM in the benchmark dtype.
# A CPU's runs are bracketed by read probes: on a shared 2-vCPU VM (`epyc3-2c`, the machines of
# docs/benchmarks.md) the read stream drifts between 18 and 25 GB/s within an hour. An
# accelerator's are not: the copy probe needs 4 GiB that the engine's KV cache holds while it is
# loaded, and HBM bandwidth does not drift that way (`h100`).
# A CPU's read probes are also the cpu backend's multi-stream reads over huge pages, the way the
# engine's weights are read: on `epyc3-2c` two streams per thread switching every 256 B read
# 1.2-1.3x a `torch.sum` over 4 KiB pages; on `intel-2c` eight streams read ~1.1-1.2x two. The
# highest counts.
# A CPU probe times 10 reads back to back (~0.5 s): the ceiling is the fastest, and the rate over
# all ten is recorded beside it. The sustained rate is no ceiling: the engine's decode exceeds it
# (up to 1.09x of it over whole 128-token runs on `epyc3-2c`).
CPU_PLAN = Plan(copy_bytes=1 << 30, read_bytes=1 << 30, matmul_n=2048, repeats=5, calls_per_timing=1,
                ceiling="read stream", bracket_runs=True,
                fast_read="flashllm.backends.cpu.read_probe:stream_reads", sustained_reads=10)
ACCELERATOR_PLAN = Plan(copy_bytes=2 << 30, read_bytes=2 << 30, matmul_n=8192, repeats=10, calls_per_timing=10,
                        ceiling="copy")
PLANS: dict[str, Plan] = {"cpu": CPU_PLAN}


def plan_for(device: str | torch.device) -> Plan:
    """The measurement plan of `device`'s type: PLANS' entry, else ACCELERATOR_PLAN (docs/benchmarks.md's)."""
    return PLANS.get(torch.device(device).type, ACCELERATOR_PLAN)


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on `device`: an accelerator launch returns before it is done, so
    a clock read without this times the launch, not the work (no-op on the CPU)."""
    kind = torch.device(device).type
    if kind != "meta":  # meta tensors (shape-only, in tests) queue no work and have no device module
        torch.get_device_module(kind).synchronize(device)


def _best_time(fn: Callable[[], object], repeats: int, device: str | torch.device, calls: int = 1) -> float:
    """Seconds per call of `fn`: the best of `repeats` timings of `calls` calls, after one warm-up call."""
    return min(_timings(fn, repeats, device, calls))


def _timings(fn: Callable[[], object], count: int, device: str | torch.device, calls: int = 1) -> list[float]:
    """Seconds per call of `fn` in each of `count` back-to-back timings of `calls` calls, after one
    warm-up call."""
    fn()  # warm up: page faults, allocator, thread pool, library handles (cuBLAS)
    times = []
    for _ in range(count):
        synchronize(device)
        start = perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        times.append((perf_counter() - start) / calls)
    return times


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu", calls: int = 1) -> float:
    """Copy a buffer of `num_bytes` (far larger than any cache): (read + written bytes) / time."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), repeats, device, calls)
    return 2 * num_bytes / seconds


def _sum_read(num_bytes: int, repeats: int, device: str, calls: int) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / _best_time(lambda: src.sum(), repeats, device, calls)


def _fast_reads(plan: Plan, num_bytes: int) -> dict[str, Callable[[], object]]:
    """{name: a call reading num_bytes once} of the plan's own read probes; empty where it has none here."""
    if not plan.fast_read:
        return {}
    module, name = plan.fast_read.split(":")
    return getattr(importlib.import_module(module), name)(num_bytes)


def read_probes(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu", calls: int = 1,
                plan: Plan | None = None) -> dict[str, float]:
    """bytes/s of each read-only stream over `num_bytes`, like a GEMV reading weights: a torch sum,
    and the plan's own reads (Plan.fast_read; plan_for(device) by default) where they run here."""
    probes = {"torch.sum": _sum_read(num_bytes, repeats, device, calls)}  # its buffer freed before the next
    for name, read in _fast_reads(plan or plan_for(device), num_bytes).items():
        probes[name] = num_bytes / _best_time(read, repeats, device, calls)
    return probes


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu", calls: int = 1) -> float:
    """The highest of read_probes(): the fastest read of memory this device is known to manage."""
    return max(read_probes(num_bytes, repeats, device, calls).values())


def measure_matmul(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5, device: str = "cpu",
                   calls: int = 1) -> float:
    """FLOP/s of an n x n x n GEMM in `dtype` on random data (zeros could take a faster path)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_time(lambda: torch.mm(a, b), repeats, device, calls)
    return 2 * n**3 / seconds


def measure(dtype: torch.dtype = torch.float32, device: str = "cpu", plan: Plan | None = None) -> Roofline:
    """Read and copy bandwidth and GEMM FLOP/s of `device`, measured now with `plan_for(device)`.

    The buffers are freed on return, before the caller's next allocation.
    """
    plan = plan or plan_for(device)
    reads = read_probes(plan.read_bytes, plan.repeats, device, plan.calls_per_timing, plan)
    return Roofline(read_bandwidth=max(reads.values()), read_probes=tuple(reads.items()),
                    copy_bandwidth=measure_bandwidth(plan.copy_bytes, plan.repeats, device, plan.calls_per_timing),
                    matmul_flops=measure_ceiling_matmul(dtype, device, plan),
                    dtype=str(dtype).removeprefix("torch."), ceiling=plan.ceiling)


class Reading(NamedTuple):
    """One probe of the bandwidth a decode ceiling divides by, bytes/s.

    ceiling: what a run's fraction divides by, the fastest single read (or copy timing) of the
    probe; sustained: the bytes of all its back-to-back reads over their whole time, where the plan
    has sustained_reads, else the ceiling (never above it).
    """

    ceiling: float
    sustained: float


def held_ceiling_probe(device: str | torch.device, plan: Plan | None = None) -> Callable[[], Reading]:
    """A call measuring the bandwidth the decode ceiling divides by, as a Reading: the plan's read
    stream (each read probe timed read by read; the highest fastest read and the highest sustained
    rate) or its copy (its best timing, both), over buffers allocated here, once, held by the call.

    For probes around and inside one timed run (bench/repeats.py): the buffers are held because a
    probe that allocates and frees its 2 GiB each time slows the engine's decode after it by ~8%
    (`epyc3-2c` in docs/benchmarks.md), while held buffers leave it within noise (1.02x); the
    churn, not the reads, is the cost.
    """
    plan = plan or plan_for(device)
    dev, repeats, calls = str(device), plan.repeats, plan.calls_per_timing
    if plan.ceiling != "read stream":
        src = torch.ones(plan.copy_bytes // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)

        def copy() -> Reading:
            rate = 2 * plan.copy_bytes / _best_time(lambda: dst.copy_(src), repeats, dev, calls)
            return Reading(rate, rate)

        return copy
    src = torch.ones(plan.read_bytes // 4, dtype=torch.float32, device=dev)
    reads: list[Callable[[], object]] = [src.sum, *_fast_reads(plan, plan.read_bytes).values()]

    def read() -> Reading:
        readings = [_read_reading(fn, plan, dev) for fn in reads]
        return Reading(max(r.ceiling for r in readings), max(r.sustained for r in readings))

    return read


def _read_reading(read: Callable[[], object], plan: Plan, device: str) -> Reading:
    """`read` (of plan.read_bytes) timed call by call, back to back, after one warm-up call."""
    times = _timings(read, plan.sustained_reads or plan.repeats, device)
    fastest = plan.read_bytes / min(times)
    return Reading(fastest, plan.read_bytes * len(times) / sum(times) if plan.sustained_reads else fastest)


def measure_ceiling_matmul(dtype: torch.dtype, device: str | torch.device, plan: Plan | None = None) -> float:
    """FLOP/s of the plan's GEMM (what the compute ceiling divides by), measured now."""
    plan = plan or plan_for(device)
    return measure_matmul(dtype, plan.matmul_n, plan.repeats, str(device), plan.calls_per_timing)
