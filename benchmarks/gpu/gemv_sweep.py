"""Tile sweep of the decode quant_matmul (M=1..4) against torch's bf16 matmul, on a GPU.

    python benchmarks/gpu/gemv_sweep.py [--json OUT.json]

Every variant is checked against the reference first. Weights rotate over enough copies that
their total passes 256 MB, so no call finds its weight in the 50 MB L2 of an H100; each copy is
called once inside one CUDA graph and the time per call is the median over graph replays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
from timing import median_ms

from flashllm.backends.cuda import triton_quant
from flashllm.backends.cuda.bench_measure import _capture
from flashllm.ops import op_specs
from flashllm.ops.quant_matmul import dequantize
from flashllm.ops.tolerances import assert_close
from flashllm.quant.weight_only import quantize_weight

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (3584, 18944), (18944, 3584), (896, 4864), (4864, 896)]
SCHEMES = [("w8a16", -1), ("w4a16", 128)]
# ("gemv", BLOCK_N, BLOCK_K, warps) of the streaming kernel, ("gemm", BLOCK_N, BLOCK_K, warps, stages) of tl.dot
TILES = [("gemv", 8, 256, 4), ("gemv", 16, 256, 4), ("gemv", 16, 512, 8), ("gemv", 32, 256, 8),
         ("gemm", 16, 128, 4, 4), ("gemm", 32, 128, 4, 4), ("gemm", 16, 64, 4, 5), ("gemm", 64, 64, 4, 3)]


def rotating(make, nbytes: int, total: int = 256 << 20) -> list:
    return [make() for _ in range(max(8, -(-total // nbytes)))]


def timed(fn, sets: list, repeats: int = 10) -> float:
    """Microseconds per call on the GPU: one CUDA graph calls fn once per input set; median over replays.

    Timing eager calls would add the Python launch path whenever it is slower than the kernel
    (it is, for small layers); in the engine these kernels run inside decode graphs too.
    """
    graph = _capture(fn, sets)  # the cuda bench's capture: warm-up on a side stream, one call per set
    graph.replay()
    return median_ms(graph.replay, repeats) * 1e3 / len(sets)


def case(k: int, n: int, scheme: str, group: int, m: int) -> dict:
    """One layer shape: the bf16 baseline, then every tile (checked, then timed)."""
    reference = op_specs()["quant_matmul"].reference

    def quantized() -> object:
        return quantize_weight(torch.randn(n, k, device="cuda") * k**-0.5, scheme, group, symmetric=True)

    weight = quantized()
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    weights = rotating(quantized, weight.nbytes)
    denses = rotating(lambda: dequantize(quantized(), torch.bfloat16), n * k * 2)
    row = {"k": k, "n": n, "scheme": scheme, "group": group, "m": m,
           "bf16_us": timed(lambda w: F.linear(x, w), denses), "tiles": {}}
    for path, *tile in TILES:
        variable = "FLASHLLM_GEMV_TILE" if path == "gemv" else "FLASHLLM_GEMM_TILE"
        os.environ[variable] = ",".join(map(str, tile))
        name = f"{path}{tuple(tile)}"
        try:
            assert_close(triton_quant.matmul(x, weight, path=path), reference(x, weight), torch.bfloat16)
            row["tiles"][name] = timed(lambda w, path=path: triton_quant.matmul(x, w, path=path), weights)
        except Exception as exc:  # a tile that fails to compile or check is reported, not fatal
            row["tiles"][name] = f"FAIL {type(exc).__name__}: {str(exc)[:80]}"
        os.environ.pop(variable, None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--rows", default="1")
    args = parser.parse_args()
    results = []
    for (k, n), (scheme, group), m in itertools.product(SHAPES, SCHEMES, [int(r) for r in args.rows.split(",")]):
        row = case(k, n, scheme, group, m)
        base = row["bf16_us"]
        ok = {t: v for t, v in row["tiles"].items() if isinstance(v, float)}
        best = row["best"] = min(ok, key=ok.get) if ok else None
        print(f"{k:>6}x{n:<6} {scheme} g{group:<4} m={m}: bf16 {base:7.1f} us | "
              + " ".join(f"{t}:{v:.1f}" if isinstance(v, float) else f"{t}:{v}" for t, v in row["tiles"].items())
              + (f" | best {best} {ok[best]:.1f} us = {base / ok[best]:.2f}x" if best else ""), flush=True)
        results.append(row)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
