"""The kernel benchmark's suite: the issue's H100 targets as cases of the single-kernel bench, and their table.

    python -m flashllm.backends.cuda.bench --suite [--json kernels.json] [--only decode,w4a16]

Each Case is the single-kernel bench's flags plus, where the issue sets one, a target; run_suite
measures them one after another against peaks measured once (bench_measure.measure_peaks) and format_table /
report turn the rows into the printed table and the JSON record.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashllm.backends.cuda import kernels
from flashllm.backends.cuda.bench_measure import (
    GRAPHED,
    METRICS,
    REP_MS,
    ROTATE_BYTES,
    WARMUP_MS,
    Inputs,
    Peaks,
    Row,
    Timer,
    build_parser,
    check,
    judge,
    measure,
)

# -- the suite -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One suite row: the single-kernel flags that build it and, where the issue sets one, its target."""

    label: str
    argv: tuple[str, ...]
    metric: str | None = None  # a key of METRICS
    goal: float | None = None


# (K, N) = (in, out) features of the issue's "4096x4096 and larger" layers (Llama-3-8B, Qwen2-7B MLPs)
QUANT_LAYERS = ((4096, 4096), (4096, 14336), (14336, 4096), (3584, 18944), (18944, 3584))
# scheme, group size, the issue's M=1 speedup over the bf16 matmul
QUANT_SCHEMES = (("w8a16", -1, 1.7), ("w4a16", 128, 3.0))
_ATTENTION = ("--heads", "32", "--kv-heads", "8", "--head-size", "128", "--block-size", "64")


def _suite_cases() -> list[Case]:
    """The issue's H100 targets (bf16): bandwidth fractions, M=1 GEMV speedups, prefill vs SDPA flash."""
    def kernel(name: str, *flags: str) -> tuple[str, ...]:
        return ("--kernel", name, "--dtype", "bfloat16", *flags)

    cases = [
        Case("rms_norm + residual 16384x4096", kernel("rms_norm", "--tokens", "16384", "--hidden", "4096"),
             "of_copy", 0.8),
        Case("silu_and_mul 16384x11008", kernel("silu_and_mul", "--tokens", "16384", "--intermediate", "11008"),
             "of_copy", 0.8),
        Case("gelu_and_mul 16384x11008", kernel("gelu_and_mul", "--tokens", "16384", "--intermediate", "11008")),
        Case("rotary 16384 tokens 32/8x128", kernel("rotary_embedding", "--tokens", "16384", *_ATTENTION)),
        Case("write_kv_cache 16384 tokens 8x128", kernel("write_kv_cache", "--tokens", "16384", *_ATTENTION)),
        # no issue target (StarCoder 2's and Cohere's norm); after the issue's rows, which tests index by position
        Case("layer_norm + residual 16384x4096", kernel("layer_norm", "--tokens", "16384", "--hidden", "4096")),
    ]
    for seqs, context in ((64, 4096), (8, 16384)):
        cases.append(Case(f"decode attn {seqs} seqs x {context}", kernel(
            "paged_attention", "--mode", "decode", "--seqs", str(seqs), "--context", str(context), *_ATTENTION),
            "of_copy", 0.7))
    prefill = kernel("paged_attention", "--mode", "prefill", "--tokens", "2048", *_ATTENTION)
    cases += [Case("prefill attn 2048", (*prefill, "--context", "2048"), "slowdown", 1.5),
              Case("prefill attn 2048 + 2048 cached", (*prefill, "--context", "4096", "--num-cached-tokens", "2048"))]
    for m, (k, n), (scheme, group, goal) in itertools.product((1, 4, 16), QUANT_LAYERS, QUANT_SCHEMES):
        cases.append(Case(
            f"{scheme}{f' g{group}' if group > 0 else ''} M={m} K={k} N={n}",
            kernel("quant_matmul", "--scheme", scheme, "--group-size", str(group), "--tokens", str(m),
                   "--hidden", str(k), "--out-features", str(n)),
            *(("speedup", goal) if m == 1 else ())))
    for tokens in (16, 256):
        cases.append(Case(f"fused_moe {tokens} tokens 8e top2 4096/14336", kernel(
            "fused_moe", "--tokens", str(tokens), "--experts", "8", "--top-k", "2", "--hidden", "4096",
            "--intermediate", "14336")))
    for seqs in (1, 32):  # DeepSeek-V2-Lite's MLA (16 heads, 512 + 64 latent row) decoding over 4096 cached tokens
        cases.append(Case(f"latent attn decode {seqs} seqs x 4096", kernel(
            "latent_attention", "--seqs", str(seqs), "--context", "4096", "--heads", "16", "--head-size", "128")))
    for tokens in (16, 256):  # multi-LoRA: rows over 4 rank-16 adapters on a 4096-wide projection
        cases.append(Case(f"lora shrink {tokens} rows 4096 -> r16", kernel(
            "lora_shrink", "--tokens", str(tokens), "--hidden", "4096")))
        cases.append(Case(f"lora expand {tokens} rows r16 -> 4096", kernel(
            "lora_expand", "--tokens", str(tokens), "--out-features", "4096")))
    return cases


SUITE = _suite_cases()


def run_suite(cases: Sequence[Case], peaks: Peaks, timer: Timer, *, device: str = "cuda",
              kernel_table: dict[str, Callable[..., Any]] | None = None,
              prepare: Callable[..., tuple[Inputs, int]] = check,
              on_row: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Measure and judge every case in order (a FAIL does not stop the rest); on_row(rows so far) after each."""
    parser, rows = build_parser(), []
    for case in cases:
        started = time.perf_counter()
        args = parser.parse_args(case.argv)
        kernel = (kernel_table or kernels.WRAPPERS)[args.kernel]
        row = measure(args, peaks, timer, device=device, kernel=kernel, prepare=prepare)
        row = judge({"case": case.label, "argv": list(case.argv), **row}, case.metric, case.goal)
        row["seconds"] = round(time.perf_counter() - started, 2)
        rows.append(row)
        print(_progress(len(rows), len(cases), row), flush=True)
        on_row(rows)
        if device.startswith("cuda"):  # the next case's inputs may need what this one held
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _peak(row: Row) -> str:
    fractions = [(row[key], name) for key, name in (("of_copy", "copy"), ("of_matmul", "mma")) if row[key] is not None]
    return "-" if not fractions else "{:.2f} {}".format(*max(fractions))


def _target(row: Row) -> str:
    if row["metric"] is None:
        return ""
    compare, unit = METRICS[row["metric"]]
    return f"{_num(row['value'], '.2f')} {compare} {row['goal']:.2f} {unit}"


def _progress(index: int, total: int, row: Row) -> str:
    return (f"[{index}/{total}] {row['case']}: {row['status']}  {_num(row['us'], '.1f')} us  "
            f"{_num(row['gbps'], '.0f')} GB/s  {_num(row['tflops'], '.1f')} TFLOP/s  {_peak(row)}  "
            f"{row['baseline'] or ''} {_num(row['baseline_us'], '.1f')} us  {row['seconds']} s"
            + (f"  ({row['error']})" if row["error"] else ""))


COLUMNS = ("#", "case", "status", "us", "GB/s", "TFLOP/s", "of peak", "baseline", "base us", "speedup", "target")


def legend(peaks: Peaks, meta: dict[str, Any]) -> str:
    """What the table's numbers are: the device, the measured peaks and how every time was taken."""
    return "\n".join([
        f"device: {meta.get('device')}; torch {meta.get('torch')}, triton {meta.get('triton')}",
        f"peaks, measured in this run: copy {peaks.copy_gbps:.0f} GB/s (2 GiB device-to-device copy, read + write",
        f"  bytes / median time), bf16 matmul {peaks.matmul_tflops:.0f} TFLOP/s (8192^3 torch.matmul)",
        "every row is checked against the op's reference first, then timed: do_bench medians (warmup "
        f"{WARMUP_MS} ms, rep {REP_MS} ms).",
        "  do_bench zeroes 256 MB before each call: every call starts with a cold L2 and runs alone, so its",
        "  launch latency (~5-10 us) is part of its time, which weighs on kernels under ~50 us.",
        "  quant_matmul rows (triton and F.linear) instead time one CUDA graph that calls the op once per copy",
        f"  of its inputs (>= {ROTATE_BYTES >> 20} MB of copies: no weight in L2); time = replay / copies, no launch.",
        "GB/s, TFLOP/s: what the kernel must move (reads + writes; attention: K/V + q + out) and compute, over its",
        "  time; of peak: the larger of GB/s / copy and TFLOP/s / matmul (mma).",
        "baselines: torch reference = the op's reference (fp32 math); F.linear = torch's bf16 F.linear (cuBLAS) on",
        "  the weight dequantized once; expert loop = a torch matmul pair per expert hit; SDPA = torch",
        "  scaled_dot_product_attention, causal, on contiguous (seqs, heads, tokens, D) q/k/v, path in the notes.",
        "speedup = baseline time / triton time; the prefill target is triton time / SDPA time.",
        "status: ok, MISS (target missed), FAIL (check or timing failed, or the target's baseline did not run).",
    ])


def _notes(row: Row) -> list[str]:
    """The row's error, then each timed callable's error or note (which SDPA path, a capture fallback)."""
    details = [f"{t['name']}: {t.get('error') or t.get('note')}" for t in row["timings"] if t.get("error") or t.get("note")]
    return ([row["error"]] if row["error"] else []) + details


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table, then notes (errors, baseline details) and a status count."""
    cells = [[str(i), row["case"], row["status"], _num(row["us"], ".1f"), _num(row["gbps"], ".0f"),
              _num(row["tflops"], ".1f"), _peak(row), row["baseline"] or "-", _num(row["baseline_us"], ".1f"),
              _num(row["speedup"], ".2f"), _target(row)] for i, row in enumerate(rows, 1)]
    widths = [max(len(line[c]) for line in [list(COLUMNS), *cells]) for c in range(len(COLUMNS))]
    left = {"case", "status", "baseline", "target"}
    lines = ["  ".join(text.ljust(w) if name in left else text.rjust(w)
                       for name, text, w in zip(COLUMNS, line, widths, strict=True)).rstrip()
             for line in [list(COLUMNS), *cells]]
    notes = [f"  #{i} {row['case']}: " + "; ".join(_notes(row)) for i, row in enumerate(rows, 1) if _notes(row)]
    counts = {status: sum(row["status"] == status for row in rows) for status in ("ok", "MISS", "FAIL")}
    return "\n".join([*lines, "notes:", *notes, "rows: " + ", ".join(f"{n} {s}" for s, n in counts.items())])


def report(rows: Sequence[Row], peaks: Peaks, meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a run: meta, peaks, timing method and every row."""
    timing = {"tool": "triton.testing.do_bench", "return_mode": "median", "warmup_ms": WARMUP_MS, "rep_ms": REP_MS,
              "l2": "do_bench zeroes 256 MB before each call", "graphed_ops": sorted(GRAPHED),
              "graph_rotation_bytes": ROTATE_BYTES}
    return {**meta, "peaks": {"copy_gbps": peaks.copy_gbps, "matmul_tflops": peaks.matmul_tflops},
            "timing": timing, "rows": list(rows)}


# -- command line --------------------------------------------------------------------------------


