"""Run under torchrun by test_torchrun.py: every rank builds the LLM, rank 0 writes the outputs."""

from __future__ import annotations

import json
import sys

from flashllm import LLM, SamplingParams

if __name__ == "__main__":
    model_dir, out_path, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    # the ranks other than 0 serve rank 0's steps inside LLM() and exit there when it is done
    llm = LLM(model_dir, device="cpu", num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump([[list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)] for o in outputs], f)
