"""Offline throughput of a JSON-schema batch of 16 against the same batch unconstrained (qwen2.5-0.5b shape, CPU).

Run: PYTHONPATH=. python benchmarks/cpu/structured_ab.py [repeats]  (under /work/notes/bin/cpu-bench on the team VM).
Prints output tokens/s per run, interleaved A/B/C (unconstrained; masks overlapped with the forward, the default;
masks computed after the forward, flashllm.structured.mask.PREFETCH off), the median ratios, and the time to first
token of a new schema.
"""

from __future__ import annotations

import statistics
import sys
import time

from flashllm.bench.shapes import shape_model_dir
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams, StructuredOutput
from flashllm.structured import mask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "tags", "body"],
          "properties": {"title": {"type": "string", "maxLength": 200},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
                         "body": {"type": "string", "maxLength": 2000}}}
PROMPTS = [f"Document {i}: write it as JSON." for i in range(16)]


def _run(llm: LLM, structured: bool, tokens: int) -> float:
    spec = StructuredOutput(json=SCHEMA) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=not structured,
                            structured_output=spec)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    llm = LLM(str(shape_model_dir("qwen2.5-0.5b")), dtype="float32", device="cpu", max_model_len=512)
    _run(llm, False, 4)  # warm up
    start = time.perf_counter()
    llm.generate(["x"], SamplingParams(max_tokens=1, structured_output=StructuredOutput(
        json={**SCHEMA, "title": "fresh"})))
    ttft_new = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(["x"], SamplingParams(max_tokens=1))
    ttft_plain = time.perf_counter() - start
    plain, constrained, after = [], [], []
    for _ in range(repeats):
        plain.append(_run(llm, False, 64))
        constrained.append(_run(llm, True, 64))
        mask.PREFETCH = False
        after.append(_run(llm, True, 64))
        mask.PREFETCH = True
    print("unconstrained tok/s", [round(x, 2) for x in plain])
    print("json-schema  tok/s", [round(x, 2) for x in constrained])
    print("json-schema, masks after the forward, tok/s", [round(x, 2) for x in after])
    print(f"ratio of medians {statistics.median(constrained) / statistics.median(plain):.3f} (masks after the "
          f"forward: {statistics.median(after) / statistics.median(plain):.3f})")
    print(f"time to first token, new schema (compile included) {ttft_new * 1e3:.0f} ms; unconstrained "
          f"{ttft_plain * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
