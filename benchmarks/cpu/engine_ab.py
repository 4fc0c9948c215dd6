"""A/B of native kernel builds through the engine: batch-1 fp32 decode of the qwen2.5-0.5b shape.

    python benchmarks/cpu/engine_ab.py --rounds 12 A=/tmp/lib_a.so B=/tmp/lib_b.so
    python benchmarks/cpu/engine_ab.py --rounds 6 --tokens 32 --prompt 2000 A=... B=...

One LLM; each round swaps every library in turn (rotating which goes first) and times one plain
greedy generation of 64 tokens (--tokens) after a 128-token prompt (--prompt). The tokens of each
library must equal the first's. Ratios: medians of per-round decode-rate ratios against the first
library.

A control arm, a copy of the first library loaded as another build (--no-control drops it), shows
what the harness reports for no change: on the team's 2-core VM one 14-round run gave the copy
1.056x (10 of 14) against its original, so a ratio within a few percent of 1 is not a result
without rounds enough to put the control near 1.000x.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import greedy_engine, load_library  # beside this file, first on sys.path

from flashllm import LLM, SamplingParams
from flashllm.backends.cpu import native
from flashllm.bench import offline
from flashllm.bench.workload import BenchRequest, warm_up_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (the context decode attends to)")
    parser.add_argument("libs", nargs="+", help="NAME=path/to/lib.so; the first is the baseline")
    parser.add_argument("--no-control", action="store_true", help="no control arm (a copy of the first library)")
    args = parser.parse_args()
    llm, request, params = greedy_engine(args.tokens, args.prompt)
    builds = [tuple(a.split("=", 1)) for a in args.libs]
    with tempfile.TemporaryDirectory() as scratch:
        if not args.no_control:  # another path, so ctypes loads it as a library of its own
            name, path = builds[0]
            builds.append((f"{name}-copy", shutil.copyfile(path, Path(scratch) / "control.so")))
        compare({name: load_library(str(path)) for name, path in builds}, llm, request, params, args.rounds)


def compare(libs: dict[str, ctypes.CDLL], llm: LLM, request: BenchRequest, params: SamplingParams, rounds: int) -> None:
    names = list(libs)
    tokens = {}
    for name, lib in libs.items():
        native._state["lib"] = lib  # native.library() hands every later call this build
        llm.generate([warm_up_prompt(request)], SamplingParams(max_tokens=2, detokenize=False))
        tokens[name] = llm.generate([request.prompt_token_ids], params)[0].outputs[0].token_ids
        if tokens[name] != tokens[names[0]]:
            print(f"{name}: tokens differ from {names[0]}'s")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            native._state["lib"] = libs[name]
            time.sleep(0.02)  # another library's workers stop spinning (thread_pool.h: ~5 ms)
            rates[name].append(offline._timed_generate(llm, [request], [params])["decode_tokens_per_s"])
        print(r, "  ".join(f"{name} {v[-1]:.2f} tokens/s" for name, v in rates.items()), flush=True)
    for name, v in rates.items():
        ratios = [a / b for a, b in zip(v, rates[names[0]], strict=True)]
        print(f"{name}: {statistics.median(ratios):.3f}x {names[0]}, faster in {sum(x > 1 for x in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
