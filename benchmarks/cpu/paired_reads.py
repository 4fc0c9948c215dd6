"""Batch-1 fp32 decode against a plain read of the same bytes, interleaved token by token.

    python benchmarks/cpu/paired_reads.py --rounds 4 [--no-llama-cpp]

The bench's ceiling is the fastest single read of a probe taken between chunks of 16 tokens; on a
shared VM whose bandwidth moves within seconds that mixes two questions, how fast the engine streams
and how the host's bandwidth moved. This diagnostic asks only the first: before each decode token
it reads a buffer of exactly the token's weight bytes once (in huge pages, alternating `torch.sum`
and the cpu backend's multi-stream reads), so every token has a read beside it in the same second.
Per run it prints the engine's rate over the faster kernel's paired rate, and, for comparison, over
the bench's ceiling (the held probe before and after the run). flashllm and llama.cpp (f32 GGUF of
the same weights) alternate first place by round. Not a ceiling: it is a mean, not a maximum.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from common import SHAPE, greedy_engine  # beside this file, first on sys.path

from flashllm.backends.cpu import huge_pages, native, read_probe
from flashllm.bench import offline
from flashllm.bench import roofline as rl
from flashllm.bench.shapes import shape_model_dir
from flashllm.bench.workload import warm_up_prompt
from flashllm.models.weight_bytes import weight_bytes

TOKENS = 128


def paired_run(tokens: Iterator[object], reads: list[tuple[str, Callable[[], object]]]) -> tuple[float, dict[str, float]]:
    """Seconds of each decode token and of each kernel's reads, token i after read i."""
    next(tokens)  # the prefill
    decode, read_s = 0.0, {name: 0.0 for name, _ in reads}
    for i in range(TOKENS - 1):
        name, read = reads[i % len(reads)]
        start = time.perf_counter()
        read()
        read_s[name] += time.perf_counter() - start
        start = time.perf_counter()
        next(tokens)
        decode += time.perf_counter() - start
    for _ in tokens:
        pass
    return decode, read_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    model_dir = shape_model_dir(SHAPE, "float32")
    llm, request, params = greedy_engine(TOKENS)
    nbytes = weight_bytes(llm.engine.parts.model).streamed
    engines: dict[str, Callable[[], Iterator[object]]] = {
        "flashllm": lambda: offline._engine_tokens(llm.engine, request.prompt_token_ids, params)}
    if not args.no_llama_cpp:
        from flashllm.bench import llamacpp_baseline as lc
        from flashllm.bench.gguf_export import cached_gguf

        cpp = lc.load(cached_gguf(model_dir, "f32", None), n_ctx=512, n_batch=128)
        lc.greedy_generate(cpp, warm_up_prompt(request), 2)
        engines["llama.cpp"] = lambda: lc.greedy_tokens(cpp, request.prompt_token_ids, TOKENS)
    # one buffer of the token's bytes (whole runs of the native reads) for every read kernel
    floats = nbytes // 4 // native.READ_RUN_FLOATS * native.READ_RUN_FLOATS
    buf = huge_pages.huge_page_empty((floats,), torch.float32)
    buf.fill_(1.0)
    reads = [("torch.sum", buf.sum)] + [(name, functools.partial(native.read_stream, buf, *pattern))
                                        for name, pattern in read_probe.PATTERNS.items()]
    probe = rl.held_ceiling_probe("cpu")
    fractions: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        names = list(engines)[r % len(engines):] + list(engines)[: r % len(engines)]
        for name in names:
            llm.reset_prefix_cache()
            before = probe()
            decode, read_s = paired_run(engines[name](), reads)
            ceiling = max(before.ceiling, probe().ceiling)
            rate = nbytes * (TOKENS - 1) / decode
            paired = {k: floats * 4 * (TOKENS - 1) / len(reads) / v for k, v in read_s.items()}
            fractions[name].append((rate / max(paired.values()), rate / ceiling))
            print(f"{r} {name}: {rate / 1e9:.1f} GB/s ({(TOKENS - 1) / decode:.2f} tokens/s); paired reads "
                  + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in paired.items())
                  + f"; bench ceiling {ceiling / 1e9:.1f}; of the paired read {fractions[name][-1][0]:.3f}, "
                  f"of the ceiling {fractions[name][-1][1]:.3f}", flush=True)
    for name, values in fractions.items():
        print(f"{name}: median {statistics.median(v[0] for v in values):.3f} of the paired read, "
              f"{statistics.median(v[1] for v in values):.3f} of the bench's ceiling")


if __name__ == "__main__":
    main()
