"""A/B of per-channel w8a16 products against fp32 activations (the 16-lane tiles), int8 ones (VNNI) and bf16 ones.

    PYTHONPATH=$PWD python benchmarks/cpu/w8_activations_ab.py --tokens 16 128 512 --rounds 6
    PYTHONPATH=$PWD python benchmarks/cpu/w8_activations_ab.py --modes fp32 bf16 --tokens 8 16 32 128 512

One layer of the qwen2.5-0.5b shape's products (q/k/v 1152 x 896, o 896 x 896, gate/up 9728 x 896,
down 896 x 4864; random weights quantized per channel, as `--quant-type weight_only_int8` does), T
tokens at once, through the cpu backend's quant_matmul paths: "fp32" with FLASHLLM_CPU_W8_ACTIVATIONS
and FLASHLLM_CPU_PROMPT_ACTIVATIONS at fp32 (the default: exact fp32 products), "int8" with both at
int8 (activations rounded to 8 bits per 64-feature block, integer products; llama.cpp's Q8_0 rounds
per 32), "bf16" with both at fp32 and the bf16 tiles on (csrc/w8_bf16.c, AVX512-BF16 CPUs; the other
arms turn them off). Each round times every arm (five passes each), the order alternating; prints
medians over rounds and each arm's speed against the first (above 1: faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flashllm.backends.cpu import native, quant
from flashllm.quant.weight_only import quantize_weight

SHAPES = ((1152, 896), (896, 896), (9728, 896), (896, 4864))
MODES = ("fp32", "int8", "bf16")


def time_arm(mode: str, xs: list[torch.Tensor], weights: list, passes: int = 5) -> float:
    """Seconds per pass over the layer's products with both activation switches at `mode`."""
    os.environ[native.W8_ACTIVATIONS_ENV] = "int8" if mode == "int8" else "fp32"
    os.environ[native.PROMPT_ACTIVATIONS_ENV] = "int8" if mode == "int8" else "fp32"
    native.w8_bf16_min(native.W8_BF16_MIN_TOKENS if mode == "bf16" else 0)
    path = quant.choose_path(weights[0], xs[0].shape[0], True)
    start = time.perf_counter()
    for _ in range(passes):
        for x, w in zip(xs, weights, strict=True):
            quant.run_path(path, x, w)
    return (time.perf_counter() - start) / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["fp32", "int8"])
    args = ap.parse_args()
    if "bf16" in args.modes and native.w8_bf16_min(native.W8_BF16_MIN_TOKENS) == 0:
        raise SystemExit("the bf16 arm needs a CPU with AVX512-BF16")
    modes = tuple(args.modes)
    torch.manual_seed(0)
    weights = [quantize_weight(torch.randn(n, k) * 0.02, "w8a16") for n, k in SHAPES]
    for tokens in args.tokens:
        xs = [torch.randn(tokens, k) for _, k in SHAPES]
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                times[mode].append(time_arm(mode, xs, weights))
        flop = 2 * tokens * sum(n * k for n, k in SHAPES)
        med = {m: statistics.median(v) for m, v in times.items()}
        arms = ", ".join(f"{m} {med[m] * 1e3:.2f} ms ({flop / med[m] / 1e9:.0f} GFLOP/s, {med[modes[0]] / med[m]:.2f}x)"
                         for m in modes)
        print(f"{tokens:4d} tokens: {arms}", flush=True)


if __name__ == "__main__":
    main()
