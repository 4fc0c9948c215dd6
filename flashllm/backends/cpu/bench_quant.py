"""Micro-benchmark of the cpu a8w8 quant_matmul bodies against an fp32 F.linear, after a correctness check.

    python -m flashllm.backends.cpu.bench_quant --n 4864 --k 896 --tokens 1,4,16,64,256 --threads 1

Prints one row per token count: ms per call of the fp32 GEMM, the a8w8 bodies (fbgemm split,
fp32 GEMM over codes) and fbgemm's own per-tensor dynamic linear (what the split costs over it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashllm.backends.cpu import quant as cpu_quant
from flashllm.ops.quant_matmul import quant_matmul
from flashllm.ops.tolerances import assert_close
from flashllm.quant import quantize_weight


def time_ms(fn: Callable[[], object], min_seconds: float, repeats: int = 5) -> float:
    """The best per-call time of `repeats` batches: the least disturbed by other work on the machine."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds / repeats or calls < 2:
            fn()
            calls += 1
        best = min(best, elapsed / calls)
    return 1e3 * best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4864, help="out_features")
    parser.add_argument("--k", type=int, default=896, help="in_features")
    parser.add_argument("--tokens", default="1,2,4,16,64,256", help="comma-separated token counts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--seconds", type=float, default=0.5, help="minimum time per measurement")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_quant.FBGEMM_READY:
        print(f"fbgemm is not usable here (engines {torch.backends.quantized.supported_engines}, "
              f"engine {torch.backends.quantized.engine}); only the fp32 paths run")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.n, args.k, generator=gen) * args.k**-0.5
    qweight = quantize_weight(weight, "a8w8")
    paths = ["a8w8_dequant"] + (["a8w8_fbgemm"] if cpu_quant.FBGEMM_READY else [])
    print(f"N={args.n} K={args.k} threads={torch.get_num_threads()} capability="
          f"{torch.backends.cpu.get_cpu_capability()}  (ms per call)")
    print(f"{'tokens':>6} {'fp32 linear':>12} " + " ".join(f"{p:>13}" for p in paths) + f" {'fbgemm raw':>11}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.k, generator=gen)
        expected = quant_matmul(x, qweight)
        row = [time_ms(lambda x=x: F.linear(x, weight), args.seconds)]
        for path in paths:
            assert_close(cpu_quant.run_path(path, x, qweight), expected, torch.float32)
            row.append(time_ms(lambda x=x, path=path: cpu_quant.run_path(path, x, qweight), args.seconds))
        if cpu_quant.FBGEMM_READY:
            packed = cpu_quant.fbgemm_packed(qweight)
            row.append(time_ms(lambda x=x, p=packed: torch.ops.quantized.linear_dynamic(x, p, True), args.seconds))
        print(f"{tokens:>6} " + " ".join(f"{v:>12.3f}" for v in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
