"""Micro-benchmark of IPEX's weight-only-quant linear against fp32 F.linear and the cpu kernel, after a correctness check.

    .nox/ipex/bin/python -m flashllm.backends.ipex.bench_woq --tokens 1 --threads 2

Prints one row per (N, K) shape (default: qwen2.5-0.5b's decode linears, qkv / o / gate_up /
down, plus N=4864 K=896): ms per call of the fp32 GEMM, then cpu and ipex bodies for w8a16
(per channel) and w4a16 (group 128, symmetric). Needs intel_extension_for_pytorch (nox -s ipex).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flashllm.backends.cpu import quant as cpu_quant
from flashllm.backends.cpu.bench_quant import time_ms
from flashllm.backends.ipex import ipex_status
from flashllm.backends.ipex.woq import woq_linear
from flashllm.ops.quant_matmul import quant_matmul
from flashllm.ops.tolerances import assert_close
from flashllm.quant import quantize_weight

# (N, K) of qwen2.5-0.5b's per-layer linears at decode: fused qkv, o_proj, fused gate_up, down_proj
QWEN_0_5B_SHAPES = "4864x896,1152x896,896x896,9728x896,896x4864"
SCHEMES = (("w8a16", -1), ("w4a16", 128))


def _row(n: int, k: int, tokens: int, seconds: float, gen: torch.Generator) -> list[float]:
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(tokens, k, generator=gen)
    row = [time_ms(lambda: F.linear(x, weight), seconds)]
    for scheme, group_size in SCHEMES:
        qweight = quantize_weight(weight, scheme, group_size if k % max(group_size, 1) == 0 else -1)
        expected = quant_matmul(x, qweight)
        assert_close(woq_linear(x, qweight), expected, torch.float32)
        assert_close(cpu_quant.quant_matmul(x, qweight), expected, torch.float32)
        row.append(time_ms(lambda q=qweight: cpu_quant.quant_matmul(x, q), seconds))
        row.append(time_ms(lambda q=qweight: woq_linear(x, q), seconds))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=QWEN_0_5B_SHAPES, help="comma-separated NxK")
    parser.add_argument("--tokens", type=int, default=1, help="rows of x (1 = batch-1 decode)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--seconds", type=float, default=0.5, help="minimum time per measurement")
    args = parser.parse_args(argv)
    ok, reason = ipex_status()
    if not ok:
        parser.error(f"IPEX is unavailable: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"tokens={args.tokens} threads={torch.get_num_threads()} capability="
          f"{torch.backends.cpu.get_cpu_capability()} {reason}  (ms per call)")
    columns = ["fp32", *(f"{where} {scheme}" for scheme, _ in SCHEMES for where in ("cpu", "ipex"))]
    print(f"{'N x K':>12} " + " ".join(f"{c:>11}" for c in columns))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        print(f"{shape:>12} " + " ".join(f"{v:>11.3f}" for v in _row(n, k, args.tokens, args.seconds, gen)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
