"""A/B of native builds on one-token paged attention alone (flashllm_decode_attention).

    python benchmarks/cpu/attention_ab.py old=/tmp/lib_old.so new=/tmp/lib_new.so

The qwen2.5-0.5b shape's heads (14 query, 2 KV, 64 features), fp32 caches in 64-slot blocks in a
shuffled order, batch x context cases from one sequence to a batch of 64, on one thread and on
two. Each build's time is its best of 5 timings of many calls, the builds taken in turn within a
case; the output of every build is compared with the first's. With --verify, rows of one sequence
(a speculative verify step's) for SmolLM2-135M's heads and this shape's instead (VERIFY_CASES).
A copy of the first library runs as a control arm (common.load_builds; --no-control drops it).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from common import CONFIG, SHAPE, add_build_arguments, load_builds  # beside this file, first on sys.path

CASES = [(1, 64), (1, 192), (1, 1024), (1, 4096), (16, 256), (64, 512)]
# --verify: rows of one sequence (a verify step's 1 + k rows, lengths L .. L + k over one block
# table) at contexts L, for SmolLM2-135M's heads and the qwen2.5-0.5b shape's (query, KV, features)
VERIFY_HEADS = {"smollm2-135m": (9, 3, 64), SHAPE: (CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"],
                                                          CONFIG["hidden_size"] // CONFIG["num_attention_heads"])}
VERIFY_CASES = [(rows, context) for context in (200, 400, 1000) for rows in (1, 5, 9)]
BLOCK = 64
ROUNDS = 15


def time_builds(libs: dict, call: tuple, out: torch.Tensor, calls: int) -> tuple[dict, dict]:
    """Each build's best of 5 timings of `calls` calls (builds in turn), and its output."""
    times, outs = {}, {}
    for name, lib in libs.items():
        out.zero_()
        lib.flashllm_decode_attention(*call)
        outs[name] = out.clone()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                lib.flashllm_decode_attention(*call)
            best = min(best, (time.perf_counter() - start) / calls)
        times[name] = best
    return times, outs


def report(label: str, times: dict, outs: dict) -> None:
    first = next(iter(times))
    cells = [f"{name} {t * 1e6:.1f} us ({times[first] / t:.2f}x, max diff "
             f"{(outs[name] - outs[first]).abs().max().item():.1e})" for name, t in times.items()]
    print(f"{label}: " + "; ".join(cells), flush=True)


def batch_cases(libs: dict, gen: torch.Generator) -> None:
    """CASES: batch sequences of one context each, every sequence its own blocks."""
    hq, hk = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    d = CONFIG["hidden_size"] // hq
    for batch, context in CASES:
        width = -(-context // BLOCK)
        blocks = batch * width + 1
        k_cache, v_cache = torch.randn(blocks, BLOCK, hk, d, generator=gen), torch.randn(blocks, BLOCK, hk, d, generator=gen)
        tables = torch.randperm(blocks, generator=gen)[: batch * width].to(torch.int32).view(batch, width)
        lens, rows = torch.full((batch,), context, dtype=torch.int32), torch.arange(batch)
        q = torch.randn(batch, hq, d, generator=gen)
        calls = max(5, 20000 // (batch * context))
        for threads in (1, 2):
            out = torch.zeros_like(q)
            call = (q.data_ptr(), hq * d, k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), width,
                    lens.data_ptr(), rows.data_ptr(), batch, hq, hk, d, BLOCK, d ** -0.5, out.data_ptr(), threads)
            report(f"{batch} x {context}, {threads} thread(s)", *time_builds(libs, call, out, calls))


def verify_cases(libs: dict, gen: torch.Generator, layers: int = 30) -> None:
    """VERIFY_CASES on one thread and two: per build the median of ROUNDS timings and the median of
    its per-round ratios to the first build (the builds in a rotating order within a round). A timed
    call is a step's `layers` layers, each over blocks of its own (shuffled), so a layer's keys are
    not left in L2 by the call before, as in a decode step."""
    for shape, (hq, hk, d) in VERIFY_HEADS.items():
        for (count, context), threads in itertools.product(VERIFY_CASES, (1, 2)):
            width = -(-(context + count) // BLOCK)
            blocks = layers * width
            k_cache, v_cache = torch.randn(blocks, BLOCK, hk, d, generator=gen), torch.randn(blocks, BLOCK, hk, d, generator=gen)
            order = torch.randperm(blocks, generator=gen).to(torch.int32).view(layers, 1, width)
            tables = [t.expand(count, width).contiguous() for t in order]  # every row: the sequence's table
            lens, rows = torch.arange(context, context + count, dtype=torch.int32), torch.arange(count)
            q = torch.randn(count, hq, d, generator=gen)
            out = torch.zeros(layers, count, hq, d)
            calls = [(q.data_ptr(), hq * d, k_cache.data_ptr(), v_cache.data_ptr(), tables[layer].data_ptr(), width,
                      lens.data_ptr(), rows.data_ptr(), count, hq, hk, d, BLOCK, d ** -0.5, out[layer].data_ptr(),
                      threads) for layer in range(layers)]
            steps = max(2, 10000 // (count * context))
            outs = {}
            for name, lib in libs.items():
                out.zero_()
                for call in calls:
                    lib.flashllm_decode_attention(*call)
                outs[name] = out.clone()
            timings = {name: [] for name in libs}
            names = list(libs)
            for round_ in range(ROUNDS):  # the builds in a rotating order, so a slow spell hits each
                for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                    start = time.perf_counter()
                    for _ in range(steps):
                        for call in calls:
                            libs[name].flashllm_decode_attention(*call)
                    timings[name].append((time.perf_counter() - start) / steps)
            first = timings[names[0]]
            cells = [f"{name} {statistics.median(t) * 1e6:.0f} us "
                     f"({statistics.median(a / b for a, b in zip(first, t, strict=True)):.2f}x, max diff "
                     f"{(outs[name] - outs[names[0]]).abs().max().item():.1e})" for name, t in timings.items()]
            print(f"{shape} {count} row(s) at {context}, {threads} thread(s): " + "; ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_build_arguments(parser)
    parser.add_argument("--verify", action="store_true", help="rows of one sequence (VERIFY_CASES) instead of CASES")
    args = parser.parse_args()
    libs = load_builds(args)
    gen = torch.Generator().manual_seed(0)
    (verify_cases if args.verify else batch_cases)(libs, gen)


if __name__ == "__main__":
    main()
