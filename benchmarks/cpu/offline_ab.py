"""A/B of native kernel builds through the engine: the offline workload (docs/benchmarks.md) on the
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

from common import CONFIG, SHAPE, add_build_arguments, engine_rounds, load_builds  # beside this file, first on sys.path

from flashllm import LLM, SamplingParams
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
    warm_up = SamplingParams(max_tokens=2, detokenize=False)

    def outputs() -> list:
        llm.generate([warm_up_prompt(requests[0])], warm_up)
        return [o.outputs[0].token_ids for o in llm.generate([r.prompt_token_ids for r in requests], params)]

    engine_rounds(load_builds(args), args.rounds, outputs,
                  lambda: offline._timed_generate(llm, requests, params)["output_tokens_per_s"], "tokens/s")


if __name__ == "__main__":
    main()
