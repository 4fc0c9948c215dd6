"""A/B of native kernel builds through the engine: the offline workload (BENCHMARKS.md) on the
qwen2.5-0.5b shape, fp32 on the CPU, in rounds.

    python benchmarks/cpu/offline_ab.py --rounds 4 A=/tmp/lib_a.so B=/tmp/lib_b.so

One LLM with the bench's CPU defaults (16 sequences, 2048 batched tokens); 16 greedy requests with
prompts of 32-256 tokens and 16-128 output tokens (EOS ignored, seed 0), all submitted at once, as
`flashllm bench throughput` runs them. Each round swaps every library in turn (rotating which goes
first) and times one generation over all of them with an empty prefix cache. Every library's tokens
must equal the first's. Ratios: medians of per-round output-token-rate ratios against the first
library; a copy of the first runs as a control arm (--no-control drops it). The prefill's large
products run in torch in every build, so a ratio here is the builds' decode steps diluted by it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import CONFIG, SHAPE, add_build_arguments, load_builds  # beside this file, first on sys.path

from flashllm import LLM, SamplingParams
from flashllm.backends.cpu import native
from flashllm.bench import offline
from flashllm.bench.shapes import shape_model_dir
from flashllm.bench.workload import random_requests, warm_up_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    add_build_arguments(parser)
    args = parser.parse_args()
    llm = LLM(str(shape_model_dir(SHAPE, "float32")), device="cpu", max_model_len=4096, max_num_seqs=16,
              max_num_batched_tokens=2048)
    requests = random_requests(16, (32, 256), (16, 128), CONFIG["vocab_size"], 0)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
              for r in requests]
    libs = load_builds(args)
    names = list(libs)
    tokens = {}
    for name, lib in libs.items():
        native._state["lib"] = lib  # native.library() hands every later call this build
        llm.generate([warm_up_prompt(requests[0])], SamplingParams(max_tokens=2, detokenize=False))
        outputs = llm.generate([r.prompt_token_ids for r in requests], params)
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
        if tokens[name] != tokens[names[0]]:
            print(f"{name}: tokens differ from {names[0]}'s")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            native._state["lib"] = libs[name]
            time.sleep(0.02)  # another library's workers stop spinning (thread_pool.h: ~5 ms)
            rates[name].append(offline._timed_generate(llm, requests, params)["output_tokens_per_s"])
        print(r, "  ".join(f"{name} {v[-1]:.2f} tokens/s" for name, v in rates.items()), flush=True)
    for name, v in rates.items():
        ratios = [a / b for a, b in zip(v, rates[names[0]], strict=True)]
        print(f"{name}: {statistics.median(ratios):.3f}x {names[0]}, faster in {sum(x > 1 for x in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
