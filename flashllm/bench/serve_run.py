"""`flashllm bench serve`: build the prompts, start a server when no --url is given, run, report."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

from flashllm.bench.serve_client import ServeRequest, ServeTarget, fetch_model_name, run_benchmark
from flashllm.bench.serve_metrics import format_table, per_request, summarize

# engine flags passed to `flashllm serve` when bench serve starts the server itself (cli/bench.py
# declares a `bench serve` flag for each)
SERVER_FLAGS = ("dtype", "device", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_prefill_tokens", "num_scheduler_steps", "kv_cache_dtype", "cachekv_int8_type",
                "tensor_parallel_size", "distributed_executor_backend")


def run_serve(args: argparse.Namespace) -> int:
    """Run the serving benchmark described by the parsed `bench serve` flags; 0 when no request failed."""
    kind, dataset_path = _dataset(args)
    if getattr(args, "baseline", None) not in (None, "none"):
        from flashllm.bench.serve_compare import check_baseline_flags

        check_baseline_flags(args)  # before prompts or weights are made
    if getattr(args, "shape", None):
        from flashllm.bench.shapes import shape_model_dir

        args.model = str(shape_model_dir(args.shape, args.dtype or "float32"))
    tokenizer = _tokenizer(args)
    requests = serve_requests(kind, dataset_path, tokenizer, args)
    if getattr(args, "baseline", None) not in (None, "none"):
        from flashllm.bench.serve_compare import run_compare

        if not args.model:
            raise SystemExit("flashllm bench serve: --baseline needs the weights both engines serve: --model DIR or "
                             "--shape NAME")
        return run_compare(args, Path(args.model), requests, _server_args(args))
    with _server(args) as (url, model):
        target = ServeTarget(url, model, args.endpoint, args.api_key)
        results, duration = asyncio.run(run_benchmark(target, requests, args.request_rate, args.max_concurrency,
                                                      args.seed, progress=not args.no_progress))
    summary = summarize(results, duration)
    print(format_table(summary))
    errors = sorted({r.error for r in results if not r.success})
    for error in errors[:5]:
        print(f"failed request: {error}")
    if args.json:
        config = {"url": url, "model": model, "endpoint": args.endpoint, "dataset": kind,
                  "num_prompts": len(requests), "request_rate": _finite_or_str(args.request_rate),
                  "max_concurrency": args.max_concurrency, "seed": args.seed,
                  "date": date.today().isoformat(), "machine": platform.processor() or platform.machine()}
        record = {"mode": "serve", **config, **summary, "requests": per_request(results)}
        args.json.write_text(json.dumps(record, indent=2, allow_nan=False))
    return 0 if summary["failed"] == 0 else 1


def serve_requests(kind: str, dataset_path: Path | None, tokenizer: Any, args: argparse.Namespace) -> list[ServeRequest]:
    """Prompts with their token counts and output lengths, from the random or ShareGPT workload.

    Random prompts go to the completions endpoint as token ids, so the server sees exactly the
    asked lengths; for chat they become text re-fitted to the asked length (the server's count,
    chat template included, is what the benchmark reports). ShareGPT prompts are sent as text.
    """
    from flashllm.bench.workload import parse_range, random_requests, sharegpt_requests

    if kind == "sharegpt":
        base = sharegpt_requests(dataset_path, tokenizer, args.num_prompts, seed=args.seed)  # type: ignore[arg-type]
        return [ServeRequest(tokenizer.decode(r.prompt_token_ids), len(r.prompt_token_ids), r.output_len)
                for r in base]
    base = random_requests(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                           len(tokenizer), args.seed)
    if args.endpoint == "completions":
        return [ServeRequest(r.prompt_token_ids, len(r.prompt_token_ids), r.output_len) for r in base]
    return [ServeRequest(_fitted_text(tokenizer, r.prompt_token_ids), len(r.prompt_token_ids), r.output_len)
            for r in base]


def _fitted_text(tokenizer: Any, token_ids: list[int]) -> str:
    """Text that re-tokenizes to about len(token_ids) tokens: random ids decoded to text usually
    re-encode to more tokens, so cut the re-encoding back to the asked length once."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:len(token_ids)])


def _dataset(args: argparse.Namespace) -> tuple[str, Path | None]:
    kind, *rest = args.dataset
    path = rest[0] if rest else args.dataset_path
    if kind not in ("random", "sharegpt") or len(rest) > 1 or (kind == "random" and rest):
        raise SystemExit(f"bad --dataset {' '.join(args.dataset)!r}: expected 'random' or 'sharegpt FILE'")
    if kind == "sharegpt" and not path:
        raise SystemExit("--dataset sharegpt needs a file: --dataset sharegpt FILE (or --dataset-path FILE)")
    return kind, Path(path) if path else None


def _tokenizer(args: argparse.Namespace) -> Any:
    from flashllm.models.gguf import is_gguf_path
    from flashllm.models.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.model and (Path(args.model).is_dir() or is_gguf_path(args.model)):
        return load_tokenizer(args.model)
    if args.url is None and args.model is None:
        from flashllm.models.default_model import resolve_model

        return load_tokenizer(resolve_model(None))
    raise SystemExit(f"cannot build prompts: --model {args.model!r} is not a local directory; pass --tokenizer DIR "
                     "(the served model's directory) so prompts can be made and counted")


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """Yield (API root, model name): the given --url, or a `flashllm serve` started here and stopped after."""
    engine_flags = _server_args(args)
    if args.url:
        if engine_flags:
            raise SystemExit(f"engine flags {' '.join(engine_flags)} only apply when bench serve starts the server; "
                             "drop them or drop --url")
        named = args.model and not Path(args.model).is_dir()  # a directory given for its tokenizer is no API name
        yield args.url, args.model if named else fetch_model_name(args.url, args.api_key)
        return
    from flashllm.testing.server import start_server

    server_args = [args.model] if args.model else []
    if args.api_key:
        server_args += ["--api-key", args.api_key]
    server = start_server(server_args + engine_flags)
    try:
        yield server.url, fetch_model_name(server.url, args.api_key)
    finally:
        server.stop()


def _server_args(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for name in SERVER_FLAGS:
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if getattr(args, "quant_type", None):
        flags += ["--quant-type", args.quant_type]
    flags += ["--enable-expert-parallel"] if getattr(args, "enable_expert_parallel", False) else []
    return flags + (["--no-prefix-caching"] if args.no_prefix_caching else [])


def _finite_or_str(value: float) -> float | str:
    return value if value != float("inf") else "inf"
