"""`flashllm bench throughput|latency|serve`: flashllm against transformers, the machine's limits and a live server."""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("bench", help="measure throughput or latency against baselines")
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode, defaults in (("throughput", ("32:256", "16:128", 16)), ("latency", ("128", "128", 1))):
        p = modes.add_parser(mode)
        group = p.add_mutually_exclusive_group()
        group.add_argument("--model", default=None, help="HF model directory")
        group.add_argument("--shape", default=None, help="a named shape of BENCHMARKS.md, e.g. qwen2.5-0.5b")
        p.add_argument("--dataset", default="random", help="random | sharegpt")
        p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
        p.add_argument("--input-len", default=defaults[0])
        p.add_argument("--output-len", default=defaults[1])
        p.add_argument("--num-prompts", type=int, default=defaults[2])
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default="float32")
        p.add_argument("--device", default="auto")
        p.add_argument("--backend", default=None)
        p.add_argument("--quant_type", "--quant-type", dest="quant_type", default="none",
                       help="none | weight_only_int8 (w8a16) | weight_only_int4 (w4a16) | w4a16_asym")
        p.add_argument("--weightonly_group_size", "--weightonly-group-size", dest="weightonly_group_size",
                       type=int, default=-1, help="-1 = per output channel, or 32 | 64 | 128")
        _add_kv_cache_flags(p)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: 4096, or the model's own when shorter)")
        p.add_argument("--baseline", nargs="+", action="extend", choices=BASELINES, default=None,
                       help="engines run on the same requests after flashllm; several may be given "
                            "(--baseline transformers llama.cpp)")
        p.add_argument("--gguf-type", choices=GGUF_TYPES, default=None,
                       help="llama.cpp baseline weights (default: the one matching --dtype)")
        p.add_argument("--baseline-batch-sizes", default="1,16", help="static batch sizes tried for the baseline")
        p.add_argument("--roofline", action="store_true", help="measure bandwidth and FLOP/s in the same run")
        p.add_argument("--json", type=Path, default=None, help="write the results as JSON")
        p.add_argument("--plot", type=Path, default=None, help="draw tokens/s per engine and batch size as a PNG")
    _add_serve_parser(modes)
    plot = modes.add_parser("plot", help="chart saved --json records: serve runs as latency vs load")
    plot.add_argument("records", nargs="+", type=Path, help="serve records (one per request rate) or one "
                                                             "throughput/latency record")
    plot.add_argument("--output", "-o", type=Path, required=True, help="PNG file to write")


def _add_kv_cache_flags(p: argparse.ArgumentParser, server: bool = False) -> None:
    """--kv-cache-dtype and --cachekv_int8_type (also --cachekv-int8-type), as predict and serve take them."""
    suffix = " (passed to the started server)" if server else ""
    p.add_argument("--kv-cache-dtype", "--kv_cache_dtype", dest="kv_cache_dtype", default=None if server else "auto",
                   help="auto | float32 | float16 | bfloat16 | int8 | fp8 (e4m3)" + suffix)
    p.add_argument("--cachekv_int8_type", "--cachekv-int8-type", dest="cachekv_int8_type",
                   choices=("dynamic", "static"), default=None if server else "dynamic",
                   help="int8/fp8 KV scales: dynamic (per token) | static (from the checkpoint)" + suffix)


BASELINES = ("none", "transformers", "llama.cpp")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # gguf_export.FILE_TYPES, kept here so --help imports no numpy

# engine flags passed to `flashllm serve` when bench serve starts the server itself
SERVER_FLAGS = ("dtype", "device", "max_model_len", "block_size", "num_kv_blocks", "max_num_seqs",
                "max_num_batched_tokens", "kv_cache_dtype", "cachekv_int8_type")


def _add_serve_parser(modes: Any) -> None:
    p = modes.add_parser("serve", help="load an OpenAI-compatible server with Poisson arrivals")
    p.add_argument("--url", default=None, help="API root, e.g. http://127.0.0.1:8000/v1 (default: start a server)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None,
                   help="with --url: the API model name (default: the first of /v1/models); without: the model "
                        "directory to serve (default: the demo model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for the prompts (default: --model's)")
    p.add_argument("--dataset", nargs="+", default=["random"], metavar="KIND [FILE]",
                   help="random | sharegpt FILE")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (same as --dataset sharegpt FILE)")
    p.add_argument("--input-len", default="32:256")
    p.add_argument("--output-len", default="16:128")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--plot", type=Path, default=None, help="draw latency and throughput at this rate as a PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag in SERVER_FLAGS:
        if flag not in ("kv_cache_dtype", "cachekv_int8_type"):
            p.add_argument(f"--{flag.replace('_', '-')}", default=None, help="passed to the started server")
    _add_kv_cache_flags(p, server=True)
    p.add_argument("--no-prefix-caching", action="store_true", help="passed to the started server")


def run(args: argparse.Namespace) -> int:
    from flashllm.bench import plot

    try:
        if args.mode == "plot":
            plot.plot_records([plot.load_record(path) for path in args.records], args.output)
            print(f"wrote {args.output}")
            return 0
        if args.plot:
            plot.check_plot_target(args.plot)  # before the benchmark, which may run for minutes
        return _serve(args) if args.mode == "serve" else _offline(args)
    except plot.PlotError as exc:
        raise SystemExit(f"flashllm bench: {exc}") from exc


def _serve(args: argparse.Namespace) -> int:
    """Run `bench serve`; with --plot, chart the record it writes (to a temporary file without --json)."""
    from flashllm.bench.plot import load_record, plot_serve
    from flashllm.bench.serve_run import run_serve

    if not args.plot:
        return run_serve(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.json = args.json or Path(tmp) / "serve.json"
        code = run_serve(args)
        plot_serve([load_record(args.json)], args.plot)
    return code


def _max_model_len(requested: int | None, model_dir: Path) -> int:
    """The benchmark's context: what was asked, else 4096 capped by the model's max_position_embeddings."""
    if requested is not None:
        return requested
    from flashllm.models.hf_config import load_hf_config

    return min(4096, load_hf_config(model_dir).max_position_embeddings)


def _offline(args: argparse.Namespace) -> int:
    import torch

    from flashllm.bench import roofline as rl
    from flashllm.bench.hf_baseline import load, run_static_batches
    from flashllm.bench.shapes import parameter_bytes, shape_model_dir
    from flashllm.llm import LLM
    from flashllm.quant import weight_bytes
    from flashllm.sampling_params import SamplingParams

    baselines = set(args.baseline or ()) - {"none"}
    if "llama.cpp" in baselines:
        _llama_cpp_ready()  # fail in one line before a benchmark that may run for minutes
    model_dir = Path(args.model) if args.model else shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype)
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, backend=args.backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=_max_model_len(args.max_model_len, model_dir), quant_type=args.quant_type, group_size=args.weightonly_group_size,
              kv_cache_dtype=args.kv_cache_dtype, cachekv_int8_type=args.cachekv_int8_type)
    requests = _requests(args, llm)
    result: dict[str, Any] = {"mode": args.mode, "model": str(model_dir), "shape": args.shape, "dtype": args.dtype,
                              "device": str(llm.engine.parts.selection.device),
                              "quant_type": args.quant_type, "group_size": args.weightonly_group_size,
                              "kv_cache_dtype": args.kv_cache_dtype, "cachekv_int8_type": args.cachekv_int8_type,
                              "loaded_weight_bytes": weight_bytes(llm.engine.parts.model).total,
                              "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                              "num_requests": len(requests), "weight_bytes": parameter_bytes(model_dir)}
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
              for r in requests]
    llm.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, detokenize=False))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    result["flashllm"] = _engine_numbers(outputs, elapsed, out_tokens, in_tokens)
    del llm  # the baselines load their own copy of the weights
    if "transformers" in baselines:
        model = load(model_dir, getattr(torch, args.dtype))
        runs = [run_static_batches(model, requests, int(b)) for b in args.baseline_batch_sizes.split(",")]
        result["transformers"] = [{"batch_size": r.batch_size, "elapsed_s": r.elapsed,
                                   "output_tokens_per_s": r.output_throughput} for r in runs]
        best = max(runs, key=lambda r: r.output_throughput)
        result["speedup_vs_best_transformers"] = result["flashllm"]["output_tokens_per_s"] / best.output_throughput
        del model
    if "llama.cpp" in baselines:
        result["llama.cpp"] = [_llama_cpp(args, model_dir, requests)]
        result["speedup_vs_llama_cpp"] = (result["flashllm"]["output_tokens_per_s"]
                                          / result["llama.cpp"][0]["output_tokens_per_s"])
    if args.roofline:
        roof = rl.measure(getattr(torch, args.dtype))
        result["roofline"] = {"read_bandwidth_gb_s": roof.bandwidth / 1e9,
                              "copy_bandwidth_gb_s": roof.copy_bandwidth / 1e9,
                              "matmul_gflop_s": roof.matmul_flops / 1e9}
        ceiling = roof.decode_ceiling(1, result["loaded_weight_bytes"])  # quantized weights read fewer bytes
        result["decode_ceiling_batch1_tokens_per_s"] = ceiling
        if args.mode == "latency":
            result["fraction_of_bandwidth_ceiling"] = result["flashllm"]["decode_tokens_per_s"] / ceiling
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        from flashllm.bench.plot import plot_throughput

        plot_throughput(result, args.plot)
    return 0


def _llama_cpp_ready() -> None:
    from flashllm.bench.llamacpp_baseline import LlamaCppUnavailable, require_llama_cpp

    try:
        require_llama_cpp()
    except LlamaCppUnavailable as exc:
        raise SystemExit(f"flashllm bench: --baseline llama.cpp: {exc}") from exc


def _llama_cpp(args: argparse.Namespace, model_dir: Path, requests: list) -> dict[str, Any]:
    """The llama.cpp record: batch 1 over the same requests, on a GGUF of the same weights."""
    from flashllm.bench.gguf_export import GGUFExportError
    from flashllm.bench.llamacpp_baseline import GGUF_TYPE_FOR_DTYPE, run_baseline

    file_type = args.gguf_type or GGUF_TYPE_FOR_DTYPE.get(args.dtype, "f32")
    try:
        return run_baseline(model_dir, requests, file_type)
    except GGUFExportError as exc:
        raise SystemExit(f"flashllm bench: --baseline llama.cpp: {exc}") from exc


def _requests(args: argparse.Namespace, llm: Any) -> list:
    from flashllm.bench.workload import parse_range, random_requests, sharegpt_requests

    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset sharegpt needs --dataset-path FILE")
        return sharegpt_requests(Path(args.dataset_path), llm.tokenizer, args.num_prompts, seed=args.seed)
    vocab = llm.engine.parts.hf_config.vocab_size
    return random_requests(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab, args.seed)


def _engine_numbers(outputs: list, elapsed: float, out_tokens: int, in_tokens: int) -> dict[str, float]:
    numbers = {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
               "total_tokens_per_s": (out_tokens + in_tokens) / elapsed}
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    numbers["mean_ttft_s"] = sum(ttfts) / len(ttfts)
    if len(outputs) == 1:
        o = outputs[0]
        n = len(o.outputs[0].token_ids)
        numbers["decode_tokens_per_s"] = (n - 1) / (o.metrics.latency - o.metrics.time_to_first_token)
    return numbers


def _print(result: dict[str, Any]) -> None:
    print(json.dumps(result, indent=2))
