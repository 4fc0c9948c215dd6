"""A/B of native kernel builds through the engine: batch-1 fp32 decode of the qwen2.5-0.5b shape.

    python benchmarks/cpu/engine_ab.py --rounds 12 A=/tmp/lib_a.so B=/tmp/lib_b.so
    python benchmarks/cpu/engine_ab.py --rounds 6 --tokens 32 --prompt 2000 A=... B=...

One LLM; each round swaps every library in turn (rotating which goes first) and times one plain
greedy generation of 64 tokens (--tokens) after a 128-token prompt (--prompt). The tokens of each
library must equal the first's. Ratios: medians of per-round decode-rate ratios against the first
library. A copy of the first library runs as a control arm (common.load_builds; --no-control
drops it): on the team's 2-core VM one 14-round run gave it 1.056x (10 of 14) against its
original.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import add_build_arguments, greedy_engine, load_builds  # beside this file, first on sys.path

from flashllm import SamplingParams
from flashllm.backends.cpu import native
from flashllm.bench import offline
from flashllm.bench.workload import warm_up_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (the context decode attends to)")
    add_build_arguments(parser)
    args = parser.parse_args()
    llm, request, params = greedy_engine(args.tokens, args.prompt)
    libs = load_builds(args)
    names = list(libs)
    tokens = {}
    for name, lib in libs.items():
        native._state["lib"] = lib  # native.library() hands every later call this build
        llm.generate([warm_up_prompt(request)], SamplingParams(max_tokens=2, detokenize=False))
        tokens[name] = llm.generate([request.prompt_token_ids], params)[0].outputs[0].token_ids
        if tokens[name] != tokens[names[0]]:
            print(f"{name}: tokens differ from {names[0]}'s")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
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
