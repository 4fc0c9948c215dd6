"""`flashllm bench throughput --lora N`: offline throughput of N random adapters spread over the requests
against the base model (and, with --lora-merged, one adapter merged at load), rounds interleaved.

Every engine is built once, with the same number of KV blocks, and stays loaded while the rounds alternate
over them: a round then costs only the timed runs (more rounds fit in a benchmark's few minutes), and no
engine meets a heap or page cache that an earlier engine's load and teardown left behind. The cpu
backend otherwise sizes each engine's KV cache from the memory free at its build, which differs from
engine to engine within one process.
"""

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
    """Rounds of the base, multi-LoRA (unless --lora-only-merged) and merged (--lora-merged) engines, all
    built once with one KV block count, over the same requests, the order rotating from round to round;
    medians and paired ratios."""
    from flashllm.bench.shapes import shape_model_dir
    from flashllm.lora import LoRARequest
    from flashllm.testing.tiny_lora import build_random_adapter

    if args.lora < 1 or args.lora_rank < 1:
        raise SystemExit("flashllm bench: --lora and --lora-rank must be at least 1")
    if args.lora_only_merged and not args.lora_merged:
        raise SystemExit("flashllm bench: --lora-only-merged compares the merged engine with the base model; "
                         "add --lora-merged")
    model_dir = Path(args.model) if args.model else shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype)
    with tempfile.TemporaryDirectory(prefix="flashllm-lora-bench-") as tmp:
        shapes = adapter_shapes(model_dir)
        loras = [LoRARequest(f"bench-{i}", i + 1, str(build_random_adapter(Path(tmp) / f"a{i}", shapes,
                                                                            r=args.lora_rank, seed=i)))
                 for i in range(args.lora)]
        kinds = ["base"] + ([] if args.lora_only_merged else ["lora"]) + (["merged"] if args.lora_merged else [])
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        engines: dict[str, Any] = {}
        num_kv_blocks: int | None = None
        for kind in kinds:  # the first engine's KV block count is every engine's
            engines[kind] = _engine(args, model_dir, kind, loras, num_kv_blocks)
            num_kv_blocks = engines[kind].engine.parts.num_blocks
        requests = _requests(args, engines["base"])
        for kind in kinds:
            _warm_up(engines[kind], kind, loras, requests[0])
        for round_index in range(args.repeats):
            # the order rotates from round to round, so no engine always runs first in a round or always
            # right after a given other one
            shift = round_index % len(kinds)
            for position, kind in enumerate(kinds[shift:] + kinds[:shift]):
                numbers = _run(engines[kind], kind, loras, requests)
                runs[kind].append({**numbers, "position_in_round": position})
        del engines
        gc.collect()
    result: dict[str, Any] = {
        "mode": "throughput-lora", "model": str(model_dir), "shape": args.shape, "dtype": args.dtype,
        "num_requests": len(requests), "num_adapters": args.lora, "lora_rank": args.lora_rank,
        "num_kv_blocks": num_kv_blocks,
        "adapter_targets": list(TARGETS), "date": date.today().isoformat(), "repeats": args.repeats,
        **{kind: median_run(numbers, KEY) for kind, numbers in runs.items()},
    }
    if "lora" in runs:
        result["lora_vs_base"] = paired_ratio(runs["lora"], runs["base"], KEY)
    if args.lora_merged:
        result["merged_vs_base"] = paired_ratio(runs["merged"], runs["base"], KEY)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _engine(args: argparse.Namespace, model_dir: Path, kind: str, loras: list[Any], num_kv_blocks: int | None) -> Any:
    """The LLM for `kind` (base | lora | merged); num_kv_blocks None: sized as the engine sizes it."""
    from flashllm.llm import LLM

    extra: dict[str, Any] = {}
    if kind == "lora":
        extra = {"enable_lora": True, "max_loras": len(loras), "max_lora_rank": args.lora_rank}
    elif kind == "merged":
        extra = {"lora_path": loras[0].lora_path}
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, backend=args.backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_scheduler_steps=args.num_scheduler_steps, max_model_len=max_model_len(args.max_model_len, model_dir),
              num_kv_blocks=num_kv_blocks, **extra)
    return llm


def _warm_up(llm: Any, kind: str, loras: list[Any], request: BenchRequest) -> None:
    """An untimed pass: the first prefill of the length sized, the adapters read and their slots filled."""
    from flashllm.sampling_params import SamplingParams

    llm.generate([warm_up_prompt(request)] * len(loras), SamplingParams(max_tokens=2, detokenize=False),
                 lora_request=list(loras) if kind == "lora" else None)


def _run(llm: Any, kind: str, loras: list[Any], requests: list[BenchRequest]) -> dict[str, Any]:
    """One timed pass of `requests` through `llm` (greedy, every output its full length), from an empty prefix cache."""
    from flashllm.sampling_params import SamplingParams

    per_request = [loras[i % len(loras)] for i in range(len(requests))] if kind == "lora" else None
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
              for r in requests]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, lora_request=per_request)
    elapsed = time.perf_counter() - start
    numbers = engine_numbers(outputs, elapsed, sum(len(o.outputs[0].token_ids) for o in outputs),
                             sum(len(r.prompt_token_ids) for r in requests))
    return {**numbers, "num_kv_blocks": llm.engine.parts.num_blocks}
