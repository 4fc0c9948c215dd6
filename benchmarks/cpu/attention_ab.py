"""A/B of native builds on one-token paged attention alone (flashllm_decode_attention).

    python benchmarks/cpu/attention_ab.py old=/tmp/lib_old.so new=/tmp/lib_new.so

The qwen2.5-0.5b shape's heads (14 query, 2 KV, 64 features), fp32 caches in 64-slot blocks in a
shuffled order, batch x context cases from one sequence to a batch of 64, on one thread and on
two. Each build's time is its best of 5 timings of many calls, the builds taken in turn within a
case; the output of every build is compared with the first's.
A copy of the first library runs as a control arm (common.load_builds; --no-control drops it).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import CONFIG, add_build_arguments, load_builds  # beside this file, first on sys.path

CASES = [(1, 64), (1, 192), (1, 1024), (1, 4096), (16, 256), (64, 512)]
BLOCK = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_build_arguments(parser)
    args = parser.parse_args()
    libs = load_builds(args)
    hq, hk = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    d = CONFIG["hidden_size"] // hq
    gen = torch.Generator().manual_seed(0)
    for batch, context in CASES:
        width = -(-context // BLOCK)
        blocks = batch * width + 1
        k_cache, v_cache = torch.randn(blocks, BLOCK, hk, d, generator=gen), torch.randn(blocks, BLOCK, hk, d, generator=gen)
        tables = torch.randperm(blocks, generator=gen)[: batch * width].to(torch.int32).view(batch, width)
        lens, rows = torch.full((batch,), context, dtype=torch.int32), torch.arange(batch)
        q = torch.randn(batch, hq, d, generator=gen)
        calls = max(5, 20000 // (batch * context))
        for threads in (1, 2):
            times, outs = {}, {}
            for name, lib in libs.items():
                out = torch.zeros_like(q)
                call = (q.data_ptr(), hq * d, k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), width,
                        lens.data_ptr(), rows.data_ptr(), batch, hq, hk, d, BLOCK, d ** -0.5, out.data_ptr(), threads)
                lib.flashllm_decode_attention(*call)
                outs[name] = out.clone()
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(calls):
                        lib.flashllm_decode_attention(*call)
                    best = min(best, (time.perf_counter() - start) / calls)
                times[name] = best
            first = next(iter(libs))
            cells = [f"{name} {t * 1e6:.1f} us ({times[first] / t:.2f}x, max diff "
                     f"{(outs[name] - outs[first]).abs().max().item():.1e})" for name, t in times.items()]
            print(f"{batch} x {context}, {threads} thread(s): " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
