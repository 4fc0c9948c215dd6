"""A/B of native kernel builds through the engine: batch-1 fp32 decode of the qwen2.5-0.5b shape.

    python benchmarks/cpu/engine_ab.py --rounds 12 A=/tmp/lib_a.so B=/tmp/lib_b.so
    python benchmarks/cpu/engine_ab.py --rounds 6 --tokens 32 --prompt 2000 A=... B=...

One LLM; each round swaps every library in turn (rotating which goes first) and times one plain
greedy generation of 64 tokens (--tokens) after a 128-token prompt (--prompt). The tokens of each
library must equal the first's. Ratios: medians of per-round decode-rate ratios against the first
library. A copy of the first library runs as a control arm (common.load_builds; --no-control
drops it): on a shared 2-vCPU VM one 14-round run gave it 1.056x (10 of 14) against its
original.
"""

from __future__ import annotations

import argparse

from common import add_build_arguments, engine_rounds, greedy_engine, load_builds  # beside this file, first on sys.path

from flashllm import SamplingParams
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
    warm_up = SamplingParams(max_tokens=2, detokenize=False)

    def outputs() -> list:
        llm.generate([warm_up_prompt(request)], warm_up)
        return llm.generate([request.prompt_token_ids], params)[0].outputs[0].token_ids

    engine_rounds(load_builds(args), args.rounds, outputs,
                  lambda: offline._timed_generate(llm, [request], [params])["decode_tokens_per_s"], "tokens/s")


if __name__ == "__main__":
    main()
