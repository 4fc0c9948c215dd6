"""A/B of the int4 x int8 decode bodies (flash_rows vs table_row) at an int4 draft's shapes.

    PYTHONPATH=$PWD python benchmarks/cpu/int4_draft_ab.py --rounds 7
    PYTHONPATH=$PWD python benchmarks/cpu/int4_draft_ab.py --tokens 1 6 9 --threads 2

The products of SmolLM2-135M quantized to int4 with groups of 64 (weight_only_int4, asymmetric as
quantize_weight makes it; random weights): (N, K) = (576, 576) q/o, (192, 576) k/v, (1536, 576)
gate/up, (576, 1536) down, for T tokens of a draft pass against flashllm's own int8 activations,
through csrc/int4_int8_kernels.c's flashllm_w4a8_gemv_mt on 1 or 2 threads. The switch
native.a8_table picks the body of passes of 4+ tokens ("rows": flash_rows; "table": table_row; 1-3
tokens run flash_rows in both). Each round times both arms (`--calls` calls each, best of three),
the order alternating; prints the median per call over rounds and rows / table (above 1: the table
body is faster). It first checks that both bodies give every token the bits it gets alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashllm.backends.cpu import native
from flashllm.quant.weight_only import quantize_weight

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))
A8_FLASH = 0  # csrc/int4_int8_kernels.c: flashllm's own activation rounding


def product(weight, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    """y = x @ W.T through the int4 x int8 kernel on `threads` row shares."""
    tokens, k = x.shape
    zeros = weight.kernel_cache["zeros"]
    status = native.library().flashllm_w4a8_gemv_mt(
        x.data_ptr(), tokens, k, weight.data.data_ptr(), weight.kernel_cache["scales"].data_ptr(),
        None if zeros is None else zeros.data_ptr(), None, weight.num_groups, y.data_ptr(), weight.out_features,
        weight.out_features, None, threads, A8_FLASH)
    if status != 0:
        raise RuntimeError(f"flashllm_w4a8_gemv_mt returned {status}")


def seconds_per_call(weight, x: torch.Tensor, y: torch.Tensor, threads: int, calls: int) -> float:
    """The best of three timings of `calls` products, per call."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            product(weight, x, y, threads)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def check_bits(weight, x: torch.Tensor, threads: int) -> None:
    """Both bodies give each token of a pass the bits it gets alone."""
    n = weight.out_features
    alone = torch.empty(x.shape[0], n)
    for t in range(x.shape[0]):
        product(weight, x[t : t + 1], alone[t : t + 1], threads)
    for table in (False, True):
        native.a8_table(table)
        for tokens in range(2, x.shape[0] + 1):
            together = torch.empty(tokens, n)
            product(weight, x[:tokens], together, threads)
            if not torch.equal(alone[:tokens], together):
                raise AssertionError(f"{'table' if table else 'rows'} body, {tokens} tokens: bits differ from alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 6, 8, 9, 10])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for n, k in SHAPES:
        w = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, "w4a16", 64, symmetric=False)
        w.kernel_cache["scales"] = w.scales.float().contiguous()
        w.kernel_cache["zeros"] = None if w.zeros is None else w.zeros.to(torch.int32).contiguous()
        weights[(n, k)] = w
    before = native.a8_table()
    try:
        for (_, k), w in weights.items():
            check_bits(w, torch.randn(max(args.tokens), k, generator=gen), 2)
        print(f"{'N x K':>11} {'thr':>3} {'T':>3} {'rows us':>9} {'table us':>9} {'rows/table':>10}")
        for threads in args.threads:
            for (n, k), w in weights.items():
                for tokens in args.tokens:
                    x, y = torch.randn(tokens, k, generator=gen), torch.empty(tokens, n)
                    times = {False: [], True: []}
                    for r in range(args.rounds):
                        for table in ((False, True) if r % 2 == 0 else (True, False)):
                            native.a8_table(table)
                            times[table].append(seconds_per_call(w, x, y, threads, args.calls))
                    rows, table = statistics.median(times[False]), statistics.median(times[True])
                    print(f"{n:>5} x {k:<4} {threads:>3} {tokens:>3} {rows * 1e6:>9.2f} {table * 1e6:>9.2f} "
                          f"{rows / table:>10.2f}", flush=True)
    finally:
        native.a8_table(before)


if __name__ == "__main__":
    main()
