"""The kernel benchmark's measuring core: inputs checked against the reference, then timed beside
torch's equivalent and rated against peaks measured in the same run.

bench.py (the `python -m flashllm.backends.cuda.bench` command) and bench_suite.py (the issue's
targets) both build on it; it imports neither.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from flashllm.backends.cuda import kernels
from flashllm.backends.cuda.bench_inputs import BUILDERS, Inputs, _attention_batch, _contiguous_kv
from flashllm.ops import op_specs
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.ops.testing import clone_inputs
from flashllm.ops.tolerances import assert_close

Row = dict[str, Any]


def _attention_flops(args: argparse.Namespace) -> float:
    """QK^T and PV multiply-adds: a query sees the cached prefix and, causally, half the new tokens."""
    seqs, q_len = _attention_batch(args)
    keys = args.context if args.mode == "decode" else args.num_cached_tokens + q_len / 2
    return 4 * seqs * q_len * args.heads * args.head_size * keys


# op -> FLOPs of one call at the parsed shape; ops missing here are judged by bytes only
FLOPS: dict[str, Callable[[argparse.Namespace], float]] = {
    "paged_attention": _attention_flops,
    "quant_matmul": lambda args: 2 * args.tokens * args.hidden * args.out_features,
    "fused_moe": lambda args: 2 * args.tokens * args.top_k * 3 * args.intermediate * args.hidden,
}


class Timed(NamedTuple):
    """A callable to time: fn(inputs) is one call; graphed rows are timed inside a CUDA graph."""

    name: str
    fn: Callable[[Inputs], Any]
    inputs: Inputs
    graphed: bool = False
    note: str = ""


def _dense_matmul_baseline(inputs: Inputs, args: argparse.Namespace, kernel: Callable[..., Any]) -> Timed:
    """torch's F.linear on the weight dequantized once to x.dtype: what the quantized kernel must beat."""
    from flashllm.ops.quant_matmul import dequantize

    x = inputs["x"]
    dense = {"x": x, "w": dequantize(inputs["weight"], x.dtype)}
    return Timed("F.linear", lambda s: F.linear(s["x"], s["w"]), dense, graphed=True)


def _expert_loop(inputs: Inputs) -> torch.Tensor:
    """One torch matmul pair per expert hit, in x.dtype (the reference does the same in fp32)."""
    x, w13, w2, weights, ids = (inputs[name] for name in ("x", "w13", "w2", "topk_weights", "topk_ids"))
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token_idx, slot_idx = (ids == expert).nonzero(as_tuple=True)
        gate, up = (x[token_idx] @ w13[expert].T).chunk(2, dim=-1)
        down = (F.silu(gate) * up) @ w2[expert].T
        out.index_add_(0, token_idx, down * weights[token_idx, slot_idx, None].to(x.dtype))
    return out


def _expert_loop_baseline(inputs: Inputs, args: argparse.Namespace, kernel: Callable[..., Any]) -> Timed:
    return Timed("expert loop", _expert_loop, inputs)


def _sdpa_candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> list[Timed]:
    """SDPA on (seqs, heads, tokens, D) q/k/v, in order of preference: flash first, the default last."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wide = {"q": q, "k": k.repeat_interleave(q.shape[1] // k.shape[1], 1),
            "v": v.repeat_interleave(q.shape[1] // v.shape[1], 1)}
    if q.shape[2] != k.shape[2]:
        # is_causal aligns the mask top-left when q_len != keys; a cached prefix needs it bottom-right
        from torch.backends.cuda import SDPAParams, can_use_flash_attention
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[2], k.shape[2])
        flash = q.is_cuda and can_use_flash_attention(SDPAParams(q, wide["k"], wide["v"], None, 0.0, False, False))
        return [Timed("SDPA flash" if flash else "SDPA default",
                      lambda s: F.scaled_dot_product_attention(s["q"], s["k"], s["v"], attn_mask=mask, scale=scale),
                      wide, note="lower-right causal mask, K/V heads repeated; "
                      + ("flash path" if flash else "flash refused these inputs: efficient or math path"))]

    def sdpa(s: Inputs, backend: Any = None, gqa: bool = False) -> torch.Tensor:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=True, scale=scale,
                                                  enable_gqa=gqa)

    flash = SDPBackend.FLASH_ATTENTION
    return [Timed("SDPA flash", lambda s: sdpa(s, flash, gqa=True), {"q": q, "k": k, "v": v}, note="enable_gqa"),
            Timed("SDPA flash", lambda s: sdpa(s, flash), wide, note="K/V heads repeated"),
            Timed("SDPA default", sdpa, wide, note="NOT the flash path (refused, see above); K/V heads repeated")]


def _sdpa_baseline(inputs: Inputs, args: argparse.Namespace, kernel: Callable[..., Any]) -> Timed | None:
    """torch SDPA on the same prefill laid out contiguously, flash where torch takes it; decode: None."""
    if args.mode == "decode":
        return None
    seqs, q_len = _attention_batch(args)
    q = inputs["q"].view(seqs, q_len, args.heads, args.head_size).transpose(1, 2).contiguous()
    k, v = (_contiguous_kv(inputs[name], inputs["block_tables"], args.context) for name in ("k_cache", "v_cache"))
    want = kernel(**clone_inputs(inputs)).view(seqs, q_len, args.heads, args.head_size).transpose(1, 2).float()
    refused = []
    for candidate in _sdpa_candidates(q, k, v, inputs["scale"]):
        try:
            got = candidate.fn(candidate.inputs).float()
        except RuntimeError as exc:  # this backend refuses the inputs: the next candidate, and the row says so
            refused.append(f"{candidate.name} ({candidate.note}): {str(exc).strip().splitlines()[0][:120]}")
            continue
        err = ((got - want).norm() / want.norm()).item()
        if err > 2e-2:
            raise AssertionError(f"{candidate.name} differs from the checked kernel by {err:.1e} (relative norm): "
                                 "the comparison would not time the same attention")
        return candidate._replace(note="; ".join([candidate.note, *(f"refused: {r}" for r in refused)]))
    raise RuntimeError("no SDPA backend ran: " + "; ".join(refused))


# op -> builder of the torch equivalent timed beside the kernel (None or missing: the op's reference)
BASELINES: dict[str, Callable[[Inputs, argparse.Namespace, Callable[..., Any]], Timed | None]] = {
    "quant_matmul": _dense_matmul_baseline,
    "fused_moe": _expert_loop_baseline,
    "paged_attention": _sdpa_baseline,
}


# -- timing --------------------------------------------------------------------------------------
# triton.testing.do_bench (the same body in triton 3.4 through 3.9, so 3.6 too) zeroes a 256 MB
# buffer before every timed call, which evicts the inputs from the L2 (50 MB on an H100). Eager
# rows rely on that flush and use one input set. It also makes each call timed alone: the launch
# latency (~5-10 us) and any wrapper time beyond the flush's own ~90 us are part of it (the copy
# peak is timed the same way, so the bandwidth fractions compare like with like). The
# quant_matmul layers are small enough for that to dominate (their Python launch path took 70-190
# us, docs/benchmarks.md), so they are timed as the engine runs them, in a CUDA graph: the graph
# calls the op once per copy of its inputs, the copies together >= ROTATE_BYTES so that no call
# finds its weight in L2, and a call's time is the replay's median over the number of copies.
WARMUP_MS, REP_MS = 25, 100
ROTATE_BYTES = 256 << 20
MIN_COPIES, MAX_COPIES = 8, 64  # >= 8 calls per replay amortize the graph launch
GRAPHED = frozenset({"quant_matmul"})

# (fn, input sets, graphed) -> milliseconds per call of fn(one set); injected so tests need no GPU
Timer = Callable[[Callable[[Inputs], Any], Sequence[Inputs], bool], float]


def _capture(fn: Callable[[Inputs], Any], sets: Sequence[Inputs]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compiles, first-call caches, allocator pools
        for inputs in sets:
            fn(inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inputs in sets:
            fn(inputs)
    return graph


def gpu_timer(fn: Callable[[Inputs], Any], sets: Sequence[Inputs], graphed: bool) -> float:
    """Milliseconds per call of fn: do_bench's median of eager calls cycling over sets, or of one
    CUDA graph's replays (one call per set) divided by len(sets)."""
    from triton.testing import do_bench

    if graphed:
        graph = _capture(fn, sets)
        return do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") / len(sets)
    cycle = itertools.cycle(sets)
    return do_bench(lambda: fn(next(cycle)), warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _nbytes(inputs: Inputs) -> int:
    return sum(v.nbytes for v in inputs.values() if isinstance(v, torch.Tensor | QuantizedWeight))


def _copies(inputs: Inputs) -> list[Inputs]:
    """inputs and enough clones that together they pass ROTATE_BYTES (MIN_COPIES..MAX_COPIES sets)."""
    count = min(max(math.ceil(ROTATE_BYTES / max(_nbytes(inputs), 1)), MIN_COPIES), MAX_COPIES)
    return [inputs] + [clone_inputs(inputs) for _ in range(count - 1)]


def _time(timer: Timer, timed: Timed) -> tuple[float, str]:
    """(ms per call, note); a graph capture that fails is timed eagerly and the note says so."""
    if not timed.graphed:
        return timer(timed.fn, [timed.inputs], False), timed.note
    sets = _copies(timed.inputs)
    try:
        return timer(timed.fn, sets, True), timed.note
    except RuntimeError as exc:
        traceback.print_exc()
        note = f"graph capture failed ({str(exc).strip()[:80]}): timed EAGERLY, launch path included"
        return timer(timed.fn, sets[:1], False), "; ".join(filter(None, [timed.note, note]))


@dataclass(frozen=True)
class Peaks:
    """The device's ceilings, measured in the run: what every fraction divides by."""

    copy_gbps: float  # device-to-device copy: bytes read + written, per second / 1e9
    matmul_tflops: float  # bf16 dense matmul


def measure_peaks(timer: Timer, device: str = "cuda", copy_bytes: int = 2 << 30, matmul_n: int = 8192) -> Peaks:
    """Copy bandwidth (a copy_bytes device-to-device copy) and the bf16 matmul_n^3 torch.matmul rate."""
    src = torch.randint(0, 256, (copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda _: dst.copy_(src), [{}], False)
    a, b = (torch.randn(matmul_n, matmul_n, device=device).to(torch.bfloat16) for _ in range(2))
    matmul_ms = timer(lambda _: torch.matmul(a, b), [{}], False)
    return Peaks(copy_gbps=2 * copy_bytes / copy_ms / 1e6, matmul_tflops=2 * matmul_n**3 / matmul_ms / 1e9)


# -- one measurement -----------------------------------------------------------------------------


def check(args: argparse.Namespace, device: str, kernel: Callable[..., Any] | None = None) -> tuple[Inputs, int]:
    """Build the benchmark inputs and assert the kernel (default: the Triton one) matches the reference.

    Returns (inputs, bytes one call must move at least). Raises AssertionError on a mismatch.
    """
    dtype = getattr(torch, args.dtype)
    inputs, nbytes = BUILDERS[args.kernel](dtype, device, args)
    kernel = kernel or kernels.WRAPPERS[args.kernel]
    reference = op_specs()[args.kernel].reference
    copies = [clone_inputs(inputs) for _ in range(2)]
    actual, expected = kernel(**copies[0]), reference(**copies[1])
    if args.kernel == "latent_attention":  # it writes the new latents too: compare the caches as well
        actual, expected = (actual, copies[0]["kv_cache"]), (expected, copies[1]["kv_cache"])
    if args.kernel == "write_kv_cache":
        actual, expected = (copies[0]["k_cache"], copies[0]["v_cache"]), (copies[1]["k_cache"], copies[1]["v_cache"])
    assert_close(actual, expected, dtype)
    return inputs, nbytes


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _timing(timer: Timer, name: str, build: Callable[[], Timed]) -> dict[str, Any]:
    """Build and time one entry; a failure is printed and recorded in the entry, not raised."""
    try:
        timed = build()
        ms, note = _time(timer, timed)
        return {"name": timed.name, "ms": ms, "graphed": timed.graphed, "note": note}
    except Exception as exc:  # one failing entry must not stop the others: its row records why
        traceback.print_exc()
        return {"name": name, "ms": None, "error": _error(exc)}


# per-row values derived from the timings; a target names one of the first four
ROW_VALUES = ("of_copy", "of_matmul", "speedup", "slowdown", "us", "gbps", "tflops", "baseline", "baseline_us")


def measure(args: argparse.Namespace, peaks: Peaks, timer: Timer, *, device: str = "cuda",
            kernel: Callable[..., Any] | None = None, prepare: Callable[..., tuple[Inputs, int]] = check,
            with_reference: bool = False) -> Row:
    """Check one kernel configuration, then time it, its torch equivalent and (with_reference, where
    that is another callable) the op's reference. A failed check or kernel timing gives status FAIL.

    prepare(args, device, kernel) -> (inputs, bytes moved) builds and checks (default `check`).
    """
    kernel = kernel or kernels.WRAPPERS[args.kernel]
    row: Row = {"kernel": args.kernel, "status": "FAIL", "error": None, "bytes": None, "flops": None,
                "timings": [], **dict.fromkeys(ROW_VALUES)}
    try:
        inputs, nbytes = prepare(args, device, kernel)
    except Exception as exc:  # a kernel that fails its check (or compile) FAILs its row; the suite goes on
        traceback.print_exc()
        return {**row, "error": "check: " + _error(exc)}
    row.update(bytes=nbytes, flops=FLOPS[args.kernel](args) if args.kernel in FLOPS else None)
    reference = op_specs()[args.kernel].reference
    as_reference = Timed("torch reference", lambda s: reference(**s), inputs)
    build_baseline = BASELINES.get(args.kernel, lambda *_: None)
    entries = [("triton", lambda: Timed("triton", lambda s: kernel(**s), inputs, graphed=args.kernel in GRAPHED)),
               ("baseline", lambda: build_baseline(inputs, args, kernel) or as_reference)]
    for name, build in entries:
        row["timings"].append(_timing(timer, name, build))
    if with_reference and row["timings"][1]["name"] != as_reference.name:
        row["timings"].append(_timing(timer, as_reference.name, lambda: as_reference))
    _derive(row, peaks)
    return row


def _derive(row: Row, peaks: Peaks) -> None:
    kernel_ms, baseline = row["timings"][0]["ms"], row["timings"][1]
    if kernel_ms is None:
        row["error"] = "timing: " + row["timings"][0]["error"]
        return
    row.update(status="ok", us=kernel_ms * 1e3, gbps=row["bytes"] / kernel_ms / 1e6, baseline=baseline["name"])
    row["of_copy"] = row["gbps"] / peaks.copy_gbps
    if row["flops"]:
        row["tflops"] = row["flops"] / kernel_ms / 1e9
        row["of_matmul"] = row["tflops"] / peaks.matmul_tflops
    if baseline["ms"] is not None:
        row.update(baseline_us=baseline["ms"] * 1e3, speedup=baseline["ms"] / kernel_ms,
                   slowdown=kernel_ms / baseline["ms"])


# metric -> (">=" or "<=": how a value meets the goal, how it reads in the table)
METRICS: dict[str, tuple[str, str]] = {
    "of_copy": (">=", "of copy"),
    "of_matmul": (">=", "of matmul"),
    "speedup": (">=", "x faster"),
    "slowdown": ("<=", "x its time"),
}


def judge(row: Row, metric: str | None, goal: float | None) -> Row:
    """Set row's target fields; status MISS when a measured row misses it, FAIL when it cannot be judged."""
    row.update(metric=metric, goal=goal, value=None, met=None)
    if metric is None or row["status"] == "FAIL":
        return row
    value = row[metric]
    if value is None:
        baseline = row["timings"][1]
        row.update(status="FAIL", error=f"no {metric}: {baseline['name']}: {baseline.get('error')}")
        return row
    met = value >= goal if METRICS[metric][0] == ">=" else value <= goal
    row.update(value=value, met=met, status="ok" if met else "MISS")
    return row


def build_parser() -> argparse.ArgumentParser:
    """The single-kernel bench's flags: the command's parser, and the language of the suite's cases."""
    description = ("Micro-benchmark of the Triton kernels: checked against the reference, then timed beside "
                   "torch's equivalent.")
    parser = argparse.ArgumentParser(prog="python -m flashllm.backends.cuda.bench", description=description)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--kernel", choices=sorted(kernels.WRAPPERS), help="check and time this one kernel")
    what.add_argument("--suite", action="store_true", help="every case of the issue's targets in one run (each "
                      "case sets its own shape flags: those given here are ignored)")
    parser.add_argument("--only", default="", help="--suite: the cases whose label contains one of these "
                        "comma-separated words")
    parser.add_argument("--json", metavar="PATH", help="also write the peaks and rows as JSON (rewritten after "
                        "each suite row)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--mode", default="decode", choices=["decode", "prefill"], help="paged_attention batch kind")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens (prefill: total new tokens)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seqs", type=int, default=64, help="decode batch size")
    parser.add_argument("--context", type=int, default=4096, help="keys per sequence (prefill: cached + new)")
    parser.add_argument("--num-cached-tokens", type=int, default=0,
                        help="prefill: keys of each sequence already cached; --context minus these are new")
    parser.add_argument("--out-features", type=int, default=4096, help="quant_matmul N (K is --hidden)")
    parser.add_argument("--scheme", default="w4a16", choices=["none", "w8a16", "w4a16"], help="quant_matmul weights")
    parser.add_argument("--group-size", type=int, default=128, help="quant_matmul scale group, -1 per channel")
    parser.add_argument("--asymmetric", action="store_true", help="quant_matmul w4a16 with zero points")
    parser.add_argument("--experts", type=int, default=8, help="fused_moe experts")
    parser.add_argument("--top-k", type=int, default=2, help="fused_moe experts per token")
    return parser
