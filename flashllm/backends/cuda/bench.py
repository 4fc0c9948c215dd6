"""Micro-benchmark of the Triton kernels: checked against the reference, then timed beside torch's equivalent.

Each line gives the time, GB/s or TFLOP/s and the fraction of the device's peaks, measured in the same run.

    python -m flashllm.backends.cuda.bench --kernel paged_attention --mode decode --dtype bfloat16
    python -m flashllm.backends.cuda.bench --kernel paged_attention --mode prefill --tokens 2048 --context 2048
    python -m flashllm.backends.cuda.bench --kernel quant_matmul --scheme w4a16 --tokens 1 --hidden 4096 --out-features 4096
    python -m flashllm.backends.cuda.bench --kernel fused_moe --tokens 16 --experts 8 --top-k 2
    python -m flashllm.backends.cuda.bench --suite [--json kernels.json] [--only decode,w4a16]

--suite measures the peaks once, then runs every case of SUITE (the issue's H100 targets) in one
process and prints a table last. A row whose check or timing fails is marked FAIL and the others
still run; the exit code is 1 when a row FAILed (a missed target, MISS, is a measurement: 0).
Needs an NVIDIA/ROCm GPU: elsewhere it says so and exits 2 (interpreter timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from flashllm.backends.cuda.bench_measure import Peaks, Row, build_parser, gpu_timer, measure, measure_peaks
from flashllm.backends.cuda.bench_suite import SUITE, format_table, legend, report, run_suite

NO_GPU = 2


def _no_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU visible to torch; Triton kernel timings need one (the interpreter's mean nothing)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install triton"
    return None


def _meta() -> dict[str, Any]:
    triton = sys.modules.get("triton")
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": getattr(triton, "__version__", None)}


def _write_json(path: str | None, rows: Sequence[Row], peaks: Peaks, meta: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report(rows, peaks, meta), f, indent=1)


def _print_single(row: Row, peaks: Peaks) -> None:
    """The single-kernel report: one line per timed callable, rated by the kernel's bytes and FLOPs."""
    print(f"  (GB/s and TFLOP/s on every line: what the {row['kernel']} kernel must move and compute, over that "
          "line's time; fractions of the peaks above)")
    for timing in row["timings"]:
        if timing["ms"] is None:
            print(f"  {timing['name']:>16}: FAILED {timing['error']}")
            continue
        ms = timing["ms"]
        rates = f"{row['bytes'] / ms / 1e6:8.1f} GB/s {row['bytes'] / ms / 1e6 / peaks.copy_gbps:5.2f} of copy"
        if row["flops"]:
            tflops = row["flops"] / ms / 1e9
            rates += f"  {tflops:7.1f} TFLOP/s {tflops / peaks.matmul_tflops:5.2f} of matmul"
        how = "; ".join(filter(None, ["CUDA graph" if timing["graphed"] else "", timing["note"]]))
        note = f"  [{how}]" if how else ""
        print(f"  {timing['name']:>16}: {ms * 1e3:9.1f} us  {rates}{note}")
    if row["speedup"] is not None:
        print(f"  triton time / {row['baseline']} time: {row['slowdown']:.2f} ({row['speedup']:.2f}x faster)")


def _single(args: argparse.Namespace, peaks: Peaks) -> int:
    if args.kernel == "paged_attention" and not 0 <= args.num_cached_tokens < args.context:
        print(f"bench: --num-cached-tokens must be in [0, --context {args.context}), got "
              f"{args.num_cached_tokens}", file=sys.stderr)
        return 1
    row = measure(args, peaks, gpu_timer, with_reference=True)
    if row["status"] == "FAIL":
        print(f"{args.kernel} ({args.dtype}): FAIL {row['error']}", file=sys.stderr)
        return 1
    print(f"{args.kernel} ({args.dtype}): matches the reference within tolerances")
    _print_single(row, peaks)
    _write_json(args.json, [row], peaks, _meta())
    return 0


def _suite(args: argparse.Namespace, peaks: Peaks) -> int:
    words = [word for word in args.only.split(",") if word]
    cases = [case for case in SUITE if not words or any(word in case.label for word in words)]
    if not cases:
        print(f"bench: --only {args.only!r} matches no suite case; labels: "
              + ", ".join(case.label for case in SUITE), file=sys.stderr)
        return 1
    meta, started = _meta(), time.perf_counter()
    rows = run_suite(cases, peaks, gpu_timer, on_row=lambda rows: _write_json(args.json, rows, peaks, meta))
    print(f"\n{legend(peaks, meta)}\n\n{format_table(rows)}\nsuite: {time.perf_counter() - started:.0f} s")
    return 1 if any(row["status"] == "FAIL" for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """Check, then time one kernel (--kernel) or the whole suite (--suite) beside the measured peaks.

    Returns the exit code: 0, 1 when a check or timing failed, NO_GPU without a GPU.
    """
    args = build_parser().parse_args(argv)
    reason = _no_gpu_reason()
    if reason is not None:
        print(f"bench: {reason}", file=sys.stderr)
        return NO_GPU
    peaks = measure_peaks(gpu_timer)
    print(f"device peaks (measured now): copy {peaks.copy_gbps:.0f} GB/s, bf16 matmul {peaks.matmul_tflops:.0f} "
          f"TFLOP/s on {torch.cuda.get_device_name()}", flush=True)
    return _suite(args, peaks) if args.suite else _single(args, peaks)


if __name__ == "__main__":
    sys.exit(main())
