"""`flashllm bench structured`: offline throughput of a JSON-schema batch against the same batch unconstrained.

Three arms run interleaved, `--repeats` times each: unconstrained, constrained by a JSON schema
(grammar masks computed while the forward runs, the default), and constrained with the masks
computed after the forward (flashllm.structured.mask.PREFETCH off). Also the time to first token
of a request with a schema the engine has not compiled yet (compile included) against an
unconstrained one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "tags", "body"],
          "properties": {"title": {"type": "string", "maxLength": 200},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
                         "body": {"type": "string", "maxLength": 2000}}}


def add_structured_parser(modes: Any) -> None:
    p = modes.add_parser("structured", help="JSON-schema batch vs the same batch unconstrained (offline, same run)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", default=None, help="HF model directory")
    group.add_argument("--shape", default=None, help="random weights of a named model shape (default qwen2.5-0.5b)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    p.add_argument("--output-len", type=int, default=64, help="most tokens per output")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each arm; medians are compared")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--json", default=None, help="write the record as JSON to this file")


def _arm(llm: Any, batch: int, tokens: int, structured: bool) -> tuple[float, int]:
    """(output tokens/s, outputs that stopped and do not parse as JSON) of one generate call."""
    from flashllm.sampling_params import SamplingParams, StructuredOutput

    spec = StructuredOutput(json=SCHEMA) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=not structured,
                            structured_output=spec)
    prompts = [f"Document {i}: write it as JSON." for i in range(batch)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    bad = 0
    for completion in (c for o in outputs for c in o.outputs):
        if structured and completion.finish_reason == "stop":
            try:
                json.loads(completion.text)
            except ValueError:
                bad += 1
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed, bad


def run_structured(args: argparse.Namespace) -> int:
    """Run the three arms and print (and with --json write) the record; 1 if a constrained output was invalid."""
    from flashllm.bench.shapes import shape_model_dir
    from flashllm.llm import LLM
    from flashllm.sampling_params import SamplingParams, StructuredOutput
    from flashllm.structured import mask

    for name in ("batch_size", "output_len", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"flashllm bench structured: --{name.replace('_', '-')} must be at least 1")
    model = args.model or str(shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype))
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    _arm(llm, args.batch_size, 4, False)  # warm up
    start = time.perf_counter()
    llm.generate(["x"], SamplingParams(max_tokens=1, structured_output=StructuredOutput(
        json={**SCHEMA, "title": "a schema not compiled yet"})))
    ttft_new = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(["x"], SamplingParams(max_tokens=1))
    ttft_plain = time.perf_counter() - start
    runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": [], "json_schema_masks_after_forward": []}
    invalid = 0
    for _ in range(args.repeats):
        runs["unconstrained"].append(_arm(llm, args.batch_size, args.output_len, False)[0])
        for name, prefetch in (("json_schema", True), ("json_schema_masks_after_forward", False)):
            mask.PREFETCH = prefetch
            try:
                rate, bad = _arm(llm, args.batch_size, args.output_len, True)
            finally:
                mask.PREFETCH = True
            runs[name].append(rate)
            invalid += bad
    plain = statistics.median(runs["unconstrained"])
    record = {"model": model, "batch_size": args.batch_size, "output_len": args.output_len, "repeats": args.repeats,
              "tokens_per_s": runs, "invalid_outputs": invalid,
              "ratio": statistics.median(runs["json_schema"]) / plain,
              "ratio_masks_after_forward": statistics.median(runs["json_schema_masks_after_forward"]) / plain,
              "ttft_new_schema_ms": ttft_new * 1e3, "ttft_unconstrained_ms": ttft_plain * 1e3}
    for name, rates in runs.items():
        print(f"{name:32s} tok/s {[round(x, 2) for x in rates]}")
    print(f"ratio of medians {record['ratio']:.3f} (masks after the forward: {record['ratio_masks_after_forward']:.3f})")
    print(f"time to first token, new schema (compile included) {record['ttft_new_schema_ms']:.0f} ms; "
          f"unconstrained {record['ttft_unconstrained_ms']:.0f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 1 if invalid else 0
