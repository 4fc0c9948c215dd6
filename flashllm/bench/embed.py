"""`flashllm bench embed`: LLM.embed against transformers on the same prompts (last-token pooling, normalized).

The baseline is what a sentence-transformers pipeline over a decoder runs: the base model (AutoModel) on
left-padded batches, the last position's state, L2-normalized. Both engines embed the same prompts in the same
rounds, interleaved `--repeats` times; each reports prompts/s and prompt tokens/s, and the run checks that the
two engines' vectors agree (their cosine), so the speed compared is that of the same result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

MIN_COSINE = 0.9999  # fp32 engines summing in different orders agree far closer than this


def add_embed_parser(modes: Any) -> None:
    p = modes.add_parser("embed", help="LLM.embed vs transformers' last-token embeddings (offline, same run)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", default=None, help="HF model directory")
    group.add_argument("--shape", default=None, help="random weights of a named model shape (default qwen3-0.6b)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per round")
    p.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--batch-size", type=int, default=16, help="transformers' batch size")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are compared")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the record as JSON to this file")


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic token-id prompts of `length` tokens, distinct from one another (no prefix-cache hits)."""
    return [[(7919 * i + 104729 * j + 13) % (vocab - 1) + 1 for j in range(length)] for i in range(count)]


def _flashllm(llm: Any, prompts: list[list[int]]) -> tuple[float, Any]:
    import torch

    from flashllm.sampling_params import Pooling

    llm.reset_prefix_cache()
    start = time.perf_counter()
    vectors = [o.outputs.embedding for o in llm.embed(prompts, Pooling("last"))]  # the baseline's pooling
    return time.perf_counter() - start, torch.tensor(vectors)


def _transformers(model: Any, prompts: list[list[int]], batch_size: int) -> tuple[float, Any]:
    """Left-padded batches (every prompt here has one length, so no padding is needed) through the base model."""
    import torch

    start = time.perf_counter()
    rows = []
    with torch.inference_mode():
        for at in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[at: at + batch_size])
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            rows.append(torch.nn.functional.normalize(hidden[:, -1].float(), dim=-1))
    return time.perf_counter() - start, torch.cat(rows)


def run_embed(args: argparse.Namespace) -> int:
    """Run both engines and print (and with --json write) the record; 1 if their vectors disagree."""
    import torch
    from transformers import AutoModel

    from flashllm.bench.shapes import shape_model_dir
    from flashllm.llm import LLM

    for name in ("num_prompts", "input_len", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"flashllm bench embed: --{name.replace('_', '-')} must be at least 1")
    model_dir = args.model or str(shape_model_dir(args.shape or "qwen3-0.6b", args.dtype))
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_model_len=args.input_len + 16)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    baseline = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    prompts = _prompts(args.num_prompts, args.input_len, llm.engine.parts.hf_config.vocab_size)
    _flashllm(llm, prompts[:2])  # warm up both
    _transformers(baseline, prompts[:2], args.batch_size)
    seconds: dict[str, list[float]] = {"flashllm": [], "transformers": []}
    cosine = 1.0
    for _ in range(args.repeats):
        ours, ours_vectors = _flashllm(llm, prompts)
        theirs, their_vectors = _transformers(baseline, prompts, args.batch_size)
        seconds["flashllm"].append(ours)
        seconds["transformers"].append(theirs)
        cosine = min(cosine, float((ours_vectors * their_vectors).sum(dim=-1).min()))
    tokens = args.num_prompts * args.input_len
    record = {"model": model_dir, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "batch_size": args.batch_size, "repeats": args.repeats, "seconds": seconds, "min_cosine": cosine,
              "prompts_per_s": {k: args.num_prompts / statistics.median(v) for k, v in seconds.items()},
              "prompt_tokens_per_s": {k: tokens / statistics.median(v) for k, v in seconds.items()}}
    record["speedup"] = statistics.median(seconds["transformers"]) / statistics.median(seconds["flashllm"])
    for name in seconds:
        print(f"{name:13s} prompts/s {record['prompts_per_s'][name]:8.2f}  prompt tokens/s "
              f"{record['prompt_tokens_per_s'][name]:9.1f}  runs {[round(s, 3) for s in seconds[name]]} s")
    print(f"flashllm / transformers (median of {args.repeats}): {record['speedup']:.2f}x; "
          f"lowest cosine between their vectors {cosine:.6f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 0 if cosine >= MIN_COSINE else 1
