"""`flashllm bench throughput --lora N`: offline throughput of N random adapters spread over the requests
against the base model (and, with --lora-merged, one adapter merged at load), rounds interleaved."""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from flashllm.bench.offline import _requests, engine_numbers, max_model_len
from flashllm.bench.repeats import median_run, paired_ratio
from flashllm.bench.workload import BenchRequest, warm_up_prompt

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = "output_tokens_per_s"


def adapter_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """{checkpoint weight name: (out, in)} of the projections a benchmark adapter adapts."""
    from flashllm.lora.merge import checkpoint_headers
    from flashllm.models.loader import safetensors_files

    shapes, _ = checkpoint_headers(safetensors_files(model_dir))
    return {n: (s[0], s[1]) for n, s in shapes.items()
            if len(s) == 2 and n.endswith(".weight") and n.rsplit(".", 2)[-2] in TARGETS}


def run_lora_bench(args: argparse.Namespace) -> int:
    """Rounds of (base, multi-LoRA[, merged]) engines over the same requests, the order rotating from round
    to round; medians and paired ratios."""
    from flashllm.bench.shapes import shape_model_dir
    from flashllm.lora import LoRARequest
    from flashllm.testing.tiny_lora import build_random_adapter

    if args.lora < 1 or args.lora_rank < 1:
        raise SystemExit("flashllm bench: --lora and --lora-rank must be at least 1")
    model_dir = Path(args.model) if args.model else shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype)
    with tempfile.TemporaryDirectory(prefix="flashllm-lora-bench-") as tmp:
        shapes = adapter_shapes(model_dir)
        loras = [LoRARequest(f"bench-{i}", i + 1, str(build_random_adapter(Path(tmp) / f"a{i}", shapes,
                                                                            r=args.lora_rank, seed=i)))
                 for i in range(args.lora)]
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "lora": [], **({"merged": []} if args.lora_merged else {})}
        requests: list[BenchRequest] = []
        kinds = list(runs)
        for round_index in range(args.repeats):
            # the order rotates from round to round, so no engine always runs first in the process (the
            # first run meets a cold heap and page cache) or always right after a given other one
            shift = round_index % len(kinds)
            for position, kind in enumerate(kinds[shift:] + kinds[:shift]):
                numbers, requests = _run(args, model_dir, kind, loras, requests)
                runs[kind].append({**numbers, "position_in_round": position})
    result: dict[str, Any] = {
        "mode": "throughput-lora", "model": str(model_dir), "shape": args.shape, "dtype": args.dtype,
        "num_requests": len(requests), "num_adapters": args.lora, "lora_rank": args.lora_rank,
        "adapter_targets": list(TARGETS), "date": date.today().isoformat(), "repeats": args.repeats,
        **{kind: median_run(numbers, KEY) for kind, numbers in runs.items()},
        "lora_vs_base": paired_ratio(runs["lora"], runs["base"], KEY),
    }
    if args.lora_merged:
        result["merged_vs_base"] = paired_ratio(runs["merged"], runs["base"], KEY)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _run(args: argparse.Namespace, model_dir: Path, kind: str, loras: list[Any],
         requests: list[BenchRequest]) -> tuple[dict[str, Any], list[BenchRequest]]:
    from flashllm.llm import LLM
    from flashllm.sampling_params import SamplingParams

    extra: dict[str, Any] = {}
    if kind == "lora":
        extra = {"enable_lora": True, "max_loras": len(loras), "max_lora_rank": args.lora_rank}
    elif kind == "merged":
        extra = {"lora_path": loras[0].lora_path}
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, backend=args.backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_scheduler_steps=args.num_scheduler_steps, max_model_len=max_model_len(args.max_model_len, model_dir),
              **extra)
    requests = requests or _requests(args, llm)
    per_request = [loras[i % len(loras)] for i in range(len(requests))] if kind == "lora" else None
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
              for r in requests]
    llm.generate([warm_up_prompt(requests[0])] * len(loras), SamplingParams(max_tokens=2, detokenize=False),
                 lora_request=list(loras) if kind == "lora" else None)  # untimed: adapters read, slots filled
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, lora_request=per_request)
    elapsed = time.perf_counter() - start
    numbers = engine_numbers(outputs, elapsed, sum(len(o.outputs[0].token_ids) for o in outputs),
                             sum(len(r.prompt_token_ids) for r in requests))
    del llm
    gc.collect()
    return numbers, requests
