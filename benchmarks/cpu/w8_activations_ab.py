"""A/B of per-channel w8a16 products against fp32 activations (the 16-lane tiles) and int8 ones (VNNI).

    PYTHONPATH=$PWD python benchmarks/cpu/w8_activations_ab.py --tokens 16 128 512 --rounds 6

One layer of the qwen2.5-0.5b shape's products (q/k/v 1152 x 896, o 896 x 896, gate/up 9728 x 896,
down 896 x 4864; random weights quantized per channel, as `--quant-type weight_only_int8` does), T
tokens at once, through the cpu backend's quant_matmul paths: "fp32" with FLASHLLM_CPU_W8_ACTIVATIONS
and FLASHLLM_CPU_PROMPT_ACTIVATIONS at fp32 (the default: exact fp32 products), "int8" with both at
int8 (activations rounded to 8 bits per 64-feature block, integer products; llama.cpp's Q8_0 rounds
per 32). Each round times both arms (five passes each), the order alternating; prints medians over
rounds and their ratio (above 1: int8 faster).
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
MODES = ("fp32", "int8")


def time_arm(mode: str, xs: list[torch.Tensor], weights: list, passes: int = 5) -> float:
    """Seconds per pass over the layer's products with both activation switches at `mode`."""
    os.environ[native.W8_ACTIVATIONS_ENV] = mode
    os.environ[native.PROMPT_ACTIVATIONS_ENV] = mode
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
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [quantize_weight(torch.randn(n, k) * 0.02, "w8a16") for n, k in SHAPES]
    for tokens in args.tokens:
        xs = [torch.randn(tokens, k) for _, k in SHAPES]
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                times[mode].append(time_arm(mode, xs, weights))
        flop = 2 * tokens * sum(n * k for n, k in SHAPES)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"{tokens:4d} tokens: fp32 {med['fp32'] * 1e3:.2f} ms ({flop / med['fp32'] / 1e9:.0f} GFLOP/s), "
              f"int8 {med['int8'] * 1e3:.2f} ms ({flop / med['int8'] / 1e9:.0f} GFLOP/s), "
              f"fp32 / int8 time {med['fp32'] / med['int8']:.2f}", flush=True)


if __name__ == "__main__":
    main()
