"""The Triton micro-benchmark's --suite on the CPU: its cases, judging, table and JSON, timed by a fake clock.

The op references stand in for the Triton kernels and every case is shrunk, so each row really
builds, checks and runs its baseline (SDPA included) without a GPU; only the times are made up.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch

from flashllm.backends.cuda import bench, bench_measure, bench_suite, kernels
from flashllm.ops import op_specs

REFERENCES = {op: spec.reference for op, spec in op_specs().items()}
PEAKS = bench_measure.Peaks(copy_gbps=3000.0, matmul_tflops=700.0)


class FakeTimer:
    """Calls fn once on the first input set (so baselines really run), records how, returns `ms`."""

    def __init__(self, ms: float = 1.0, refuse_graphs: bool = False) -> None:
        self.ms, self.refuse_graphs, self.calls = ms, refuse_graphs, []

    def __call__(self, fn: Any, sets: list[dict[str, Any]], graphed: bool) -> float:
        self.calls.append((graphed, len(sets)))
        if graphed and self.refuse_graphs:
            raise RuntimeError("operation not permitted when stream is capturing")
        fn(sets[0])
        return self.ms


def shrink(args: argparse.Namespace) -> None:
    """The same case at a CPU size: big dimensions / 64, group and block sizes that still divide them."""
    for name in ("tokens", "hidden", "intermediate", "context", "num_cached_tokens", "out_features"):
        if getattr(args, name) >= 256:
            setattr(args, name, getattr(args, name) // 64)
    args.seqs, args.block_size = min(args.seqs, 2), 16
    if args.group_size > 0:
        args.group_size = 8


def cpu_check(args: argparse.Namespace, device: str, kernel: Any) -> tuple[dict[str, Any], int]:
    shrink(args)
    return bench_measure.check(args, "cpu", kernel)


def run(cases: list[bench_suite.Case], timer: FakeTimer | None = None, prepare: Any = cpu_check) -> list[dict[str, Any]]:
    return bench_suite.run_suite(cases, PEAKS, timer or FakeTimer(), device="cpu", kernel_table=REFERENCES,
                           prepare=prepare)


def case(label: str) -> bench_suite.Case:
    return next(c for c in bench_suite.SUITE if c.label == label)


def test_suite_without_a_gpu_exits_with_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the suite would really run")
    assert bench.main(["--suite"]) == bench.NO_GPU
    assert "no CUDA/ROCm GPU" in capsys.readouterr().err


def test_suite_and_kernel_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        bench_measure.build_parser().parse_args(["--suite", "--kernel", "rms_norm"])
    with pytest.raises(SystemExit):
        bench_measure.build_parser().parse_args([])


def test_the_suite_holds_the_issues_targets() -> None:
    parser = bench_measure.build_parser()
    parsed = [(c, parser.parse_args(c.argv)) for c in bench_suite.SUITE]
    assert all(args.dtype == "bfloat16" for _, args in parsed)
    targets = {(args.kernel, args.mode if args.kernel == "paged_attention" else None, c.metric, c.goal)
               for c, args in parsed if c.goal is not None}
    assert {("rms_norm", None, "of_copy", 0.8), ("silu_and_mul", None, "of_copy", 0.8),
            ("paged_attention", "decode", "of_copy", 0.7), ("paged_attention", "prefill", "slowdown", 1.5),
            ("quant_matmul", None, "speedup", 1.7), ("quant_matmul", None, "speedup", 3.0)} == targets
    decode = {(args.seqs, args.context) for c, args in parsed if args.kernel == "paged_attention" and c.goal == 0.7}
    assert {context for _, context in decode} == {4096, 16384}
    prefill = [args for c, args in parsed if c.metric == "slowdown"]
    assert [(a.tokens, a.context, a.num_cached_tokens, a.heads, a.kv_heads, a.head_size) for a in prefill] == [
        (2048, 2048, 0, 32, 8, 128)]
    quant = [(args, c.goal) for c, args in parsed if args.kernel == "quant_matmul"]
    for m in (1, 4, 16):
        for scheme, group, goal in (("w8a16", -1, 1.7), ("w4a16", 128, 3.0)):
            layers = {(a.hidden, a.out_features) for a, g in quant
                      if (a.tokens, a.scheme, a.group_size) == (m, scheme, group) and g == (goal if m == 1 else None)}
            assert layers == set(bench_suite.QUANT_LAYERS)
    assert min(k * n for k, n in bench_suite.QUANT_LAYERS) >= 4096 * 4096
    assert {args.kernel for _, args in parsed} == set(kernels.WRAPPERS)


def test_every_case_builds_checks_and_is_timed_with_its_baseline() -> None:
    timer = FakeTimer(ms=1.0)
    rows = run(bench_suite.SUITE, timer)
    assert [row["case"] for row in rows] == [c.label for c in bench_suite.SUITE]
    assert all(row["status"] in ("ok", "MISS") and row["us"] == 1000.0 for row in rows), [
        (row["case"], row["error"]) for row in rows if row["status"] == "FAIL"]
    for row in rows:
        how = bench_measure.METRICS[row["metric"]][0] if row["metric"] else None
        compare = {">=": float.__ge__, "<=": float.__le__}[how] if how else None
        if compare is not None:
            assert row["met"] == compare(row["value"], row["goal"])
            assert row["status"] == ("ok" if row["met"] else "MISS")
        assert row["gbps"] == pytest.approx(row["bytes"] / 1e6)  # bytes per 1 ms, in GB/s
        assert row["of_copy"] == pytest.approx(row["gbps"] / PEAKS.copy_gbps)
    by_kernel = {row["kernel"]: row for row in rows}
    assert by_kernel["quant_matmul"]["baseline"] == "F.linear"
    assert by_kernel["fused_moe"]["baseline"] == "expert loop"
    assert by_kernel["rms_norm"]["baseline"] == "torch reference"
    assert by_kernel["quant_matmul"]["tflops"] is not None and by_kernel["rms_norm"]["tflops"] is None
    # quant_matmul (kernel and F.linear) is graphed over rotating copies; everything else is one eager set
    graphed = [calls for graphed, calls in timer.calls if graphed]
    assert len(graphed) == 2 * sum(row["kernel"] == "quant_matmul" for row in rows)
    assert all(calls >= bench_measure.MIN_COPIES for calls in graphed)
    assert all(calls == 1 for graphed, calls in timer.calls if not graphed)


def test_prefill_is_compared_with_sdpa_and_says_which_path() -> None:
    rows = run([case("prefill attn 2048"), case("prefill attn 2048 + 2048 cached")])
    for row in rows:
        sdpa = row["timings"][1]
        assert row["baseline"].startswith("SDPA") and row["baseline_us"] == 1000.0
        assert row["tflops"] is not None and row["of_matmul"] is not None
        if row["baseline"] == "SDPA default":  # no flash on a CPU: the row must say it is not the flash path
            assert "NOT the flash path" in sdpa["note"] or "flash refused" in sdpa["note"]
    assert rows[0]["slowdown"] == 1.0 and rows[0]["status"] == "ok"
    assert "lower-right" in rows[1]["timings"][1]["note"]


def test_a_failed_check_marks_its_row_and_the_suite_goes_on() -> None:
    def failing(args: argparse.Namespace, device: str, kernel: Any) -> tuple[dict[str, Any], int]:
        if args.kernel == "silu_and_mul":
            raise AssertionError("Tensor-likes are not close!")
        return cpu_check(args, device, kernel)

    rows = run(bench_suite.SUITE[:3], prepare=failing)
    assert [row["status"] == "FAIL" for row in rows] == [False, True, False]
    assert rows[2]["us"] == 1000.0  # measured after the failure
    assert rows[1]["error"].startswith("check: AssertionError") and rows[1]["us"] is None
    table = bench_suite.format_table(rows)
    assert "FAIL" in table and "Tensor-likes are not close" in table and table.endswith(", 1 FAIL")


def test_targets_are_judged_against_their_goal() -> None:
    def row(**values: Any) -> dict[str, Any]:
        return {"status": "ok", "error": None, "timings": [{}, {"name": "SDPA flash", "ms": None, "error": "x"}],
                **dict.fromkeys(bench_measure.ROW_VALUES), **values}

    assert bench_measure.judge(row(of_copy=0.79), "of_copy", 0.8)["status"] == "MISS"
    assert bench_measure.judge(row(of_copy=0.8), "of_copy", 0.8)["status"] == "ok"
    assert bench_measure.judge(row(slowdown=1.6), "slowdown", 1.5)["status"] == "MISS"
    assert bench_measure.judge(row(slowdown=1.2), "slowdown", 1.5)["status"] == "ok"
    assert bench_measure.judge(row(speedup=2.9), "speedup", 3.0)["status"] == "MISS"
    assert bench_measure.judge(row(), None, None)["status"] == "ok"
    unjudged = bench_measure.judge(row(), "slowdown", 1.5)  # the baseline did not run: the target cannot be judged
    assert unjudged["status"] == "FAIL" and "SDPA flash" in unjudged["error"]


def test_table_and_json_carry_every_row() -> None:
    rows = run([case("rms_norm + residual 16384x4096"), case("w4a16 g128 M=1 K=4096 N=4096")], FakeTimer(ms=0.5))
    meta = {"device": "fake", "torch": torch.__version__, "triton": None}
    table = bench_suite.format_table(rows)
    header = table.splitlines()[0].split()
    assert header[:3] == ["#", "case", "status"] and "speedup" in header and "target" in header
    for row in rows:
        assert row["case"] in table
    assert ">= 3.00 x faster" in table and ">= 0.80 of copy" in table
    assert "launch latency" in bench_suite.legend(PEAKS, meta)
    document = json.loads(json.dumps(bench_suite.report(rows, PEAKS, meta)))
    assert document["peaks"] == {"copy_gbps": 3000.0, "matmul_tflops": 700.0}
    assert [r["case"] for r in document["rows"]] == [row["case"] for row in rows]
    assert document["timing"]["return_mode"] == "median"


def test_a_refused_graph_capture_is_timed_eagerly_and_said() -> None:
    rows = run([case("w8a16 M=1 K=4096 N=4096")], FakeTimer(refuse_graphs=True))
    assert rows[0]["status"] in ("ok", "MISS")
    assert all("timed EAGERLY" in timing["note"] for timing in rows[0]["timings"])
    assert "timed EAGERLY" in bench_suite.format_table(rows)


def test_peaks_are_bytes_and_flops_over_the_measured_time() -> None:
    peaks = bench_measure.measure_peaks(FakeTimer(ms=2.0), device="cpu", copy_bytes=1 << 20, matmul_n=64)
    assert peaks.copy_gbps == pytest.approx(2 * (1 << 20) / 2.0 / 1e6)
    assert peaks.matmul_tflops == pytest.approx(2 * 64**3 / 2.0 / 1e9)


def test_single_kernel_report_rates_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_measure.build_parser().parse_args(case("prefill attn 2048").argv)
    row = bench_measure.measure(args, PEAKS, FakeTimer(), device="cpu", kernel=REFERENCES["paged_attention"],
                        prepare=cpu_check, with_reference=True)
    bench._print_single(row, PEAKS)
    out = capsys.readouterr().out
    assert [t["name"] for t in row["timings"]][0] == "triton" and len(row["timings"]) == 3
    assert "SDPA" in out and "torch reference" in out and out.count("of matmul") == 3
    assert "triton time / SDPA" in out
