"""`flashllm bench throughput | latency`: flashllm, its baselines and the machine's ceilings in one run.

The GPU workloads of docs/benchmarks.md, bf16, each engine on the same GPU (transformers is loaded onto
the device flashllm ran on; clocks are read after a device synchronize):

    # decode latency: batch 1, prompt 128, 128 new tokens
    flashllm bench latency --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --baseline transformers --baseline-batch-sizes 1 --roofline --json latency-0.5b.json
    flashllm bench latency --shape qwen2.5-7b --device cuda --dtype bfloat16 \
        --baseline transformers --baseline-batch-sizes 1 --roofline --json latency-7b.json
    # offline throughput: 256 requests, input and output lengths uniform in [100, 1024] (nano-vllm's recipe)
    flashllm bench throughput --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --baseline transformers --baseline-batch-sizes 64,256 --roofline --json throughput-0.5b.json
    flashllm bench throughput --shape qwen2.5-7b --device cuda --dtype bfloat16 --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --baseline transformers --baseline-batch-sizes 64,256 --roofline --json throughput-7b.json

The first run of a shape writes its random weights (qwen2.5-7b: ~15 GB of bf16 safetensors, a
tensor at a time) under $FLASHLLM_CACHE_DIR or ~/.cache/flashllm. A transformers batch size that
runs out of GPU memory is recorded as {"batch_size": b, "error": "out of memory"} and the others
still run. On cuda the roofline measures a 2 GiB copy (bytes read + written), a read-only stream
and an 8192^3 GEMM in the benchmark dtype, and the decode ceiling divides by the copy bandwidth
("ceiling_bandwidth": "copy"); on the CPU it divides by the read stream (see roofline.PLANS).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from collections.abc import Iterator
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

from flashllm.bench.repeats import (
    FRACTIONS,
    Probe,
    bandwidth_fraction,
    bracketed_run,
    chunked_record,
    median_run,
    paired_ratio,
    probed_decode,
    times_in_chunks,
)
from flashllm.bench.workload import BenchRequest, warm_up_prompt
from flashllm.config import speculative_flags_config


def run_offline(args: argparse.Namespace) -> int:
    """Run the workload through flashllm (once per --quant_type) and each baseline, --repeats rounds of
    them all; print and save the record."""
    import torch

    from flashllm.bench.shapes import parameter_bytes, shape_model_dir

    speculative = speculative_flags_config(lambda dest: getattr(args, dest, None))
    if speculative is not None:
        from flashllm.bench.shapes import shape_model_dir
        from flashllm.bench.speculative import run_speculative

        model_dir = Path(args.model) if args.model else shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype)
        return run_speculative(args, model_dir, speculative)
    baselines = set(args.baseline or ()) - {"none"}
    if "llama.cpp" in baselines:
        _llama_cpp_ready(args)  # fail in one line before a benchmark that may run for minutes
    quant_types = [q.strip() for q in args.quant_type.split(",") if q.strip()] or ["none"]
    model_dir = Path(args.model) if args.model else shape_model_dir(args.shape or "qwen2.5-0.5b", args.dtype)
    result: dict[str, Any] = {"mode": args.mode, "model": str(model_dir), "shape": args.shape, "dtype": args.dtype,
                              "quant_type": quant_types[0], "group_size": args.weightonly_group_size,
                              "moe_quant_type": getattr(args, "moe_quant_type", None),
                              "quantize_lm_head": getattr(args, "quantize_lm_head", False),
                              "kv_cache_dtype": args.kv_cache_dtype, "cachekv_int8_type": args.cachekv_int8_type,
                              "num_scheduler_steps": getattr(args, "num_scheduler_steps", None),
                              "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
                              "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                              "weight_bytes": parameter_bytes(model_dir)}
    requests: list[BenchRequest] = []
    flash: dict[str, list[dict[str, Any]]] = {q: [] for q in quant_types}
    infos: dict[str, dict[str, Any]] = {}
    hf_rounds: list[tuple[list[dict[str, Any]], dict[str, float] | None]] = []
    llama_rounds: list[dict[str, Any]] = []
    # Round-robin: each round runs every engine once, so a slow phase of a shared host falls on one
    # round of every engine rather than on all runs of one; ratios are taken within a round.
    gemm_probes: list[float] = []  # FLOP/s after each round but the last; the roofline probes after that one
    for round_index in range(args.repeats):
        for quant_type in quant_types:
            numbers, infos[quant_type], requests = _flashllm_run(args, model_dir, quant_type, requests)
            flash[quant_type].append(numbers)
        if "transformers" in baselines:
            hf_rounds.append(_transformers_round(args, model_dir, requests, infos[quant_types[0]]["device"]))
        if "llama.cpp" in baselines:
            llama_rounds.append(_llama_cpp(args, model_dir, requests))
        if args.roofline and round_index < args.repeats - 1:
            gemm_probes.append(_gemm_probe(getattr(torch, args.dtype), infos[quant_types[0]]["device"]))
    first = infos[quant_types[0]]
    result.update(device=first["device"], num_requests=len(requests), loaded_weight_bytes=first["loaded_weight_bytes"],
                  streamed_weight_bytes=first["streamed_weight_bytes"])
    key = _rate_key(args)
    result["flashllm"] = {"quantized_lm_head": first["quantized_lm_head"], **median_run(flash[quant_types[0]], key)}
    if len(quant_types) > 1:
        result["quant_runs"] = [{"quant_type": q, **infos[q], **median_run(flash[q], key),
                                 "speedup_vs_first": paired_ratio(flash[q], flash[quant_types[0]], key)}
                                for q in quant_types]
    if hf_rounds:
        _transformers_record(args, hf_rounds, flash[quant_types[0]], result)
    if llama_rounds:
        result["llama.cpp"] = [median_run(llama_rounds, key)]
        result["speedup_vs_llama_cpp"] = paired_ratio(flash[quant_types[0]], llama_rounds, "output_tokens_per_s")
    if args.repeats > 1:
        result["speedup_method"] = "median over rounds of the ratio within a round (each round runs every engine once)"
    if args.roofline:
        _roofline(args, model_dir, requests, result, getattr(torch, args.dtype), gemm_probes)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        from flashllm.bench.plot import plot_throughput

        plot_throughput(result, args.plot)
    return 0


def _flashllm_run(args: argparse.Namespace, model_dir: Path, quant_type: str,
                  requests: list[BenchRequest]) -> tuple[dict[str, float], dict[str, Any], list[BenchRequest]]:
    """One timed run of a fresh flashllm engine over the requests (drawn from its tokenizer on the
    first call), bracketed by probes where _bracket_probe says so; frees the engine after."""
    import gc

    from flashllm.llm import LLM
    from flashllm.models.weight_bytes import weight_bytes
    from flashllm.quant.spec import LM_HEAD_SCHEMES, QUANT_TYPES
    from flashllm.sampling_params import SamplingParams

    # --quantize-lm-head applies to the weight-only runs of a comma list; the float run stays float
    quantized_head = getattr(args, "quantize_lm_head", False) and QUANT_TYPES.get(quant_type.lower(), ("",))[0] in LM_HEAD_SCHEMES

    from flashllm.bench.peak_memory import peak_rss_bytes, reset_peak

    peak_from_here = reset_peak()  # this engine's peak, not the previous engine's
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, backend=args.backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_scheduler_steps=getattr(args, "num_scheduler_steps", None), max_model_len=max_model_len(args.max_model_len, model_dir), quant_type=quant_type,
              group_size=args.weightonly_group_size, kv_cache_dtype=args.kv_cache_dtype,
              quantize_lm_head=quantized_head, cachekv_int8_type=args.cachekv_int8_type,
              moe_quant_type=getattr(args, "moe_quant_type", None), enforce_eager=getattr(args, "enforce_eager", False),
              tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
              distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
              enable_expert_parallel=getattr(args, "enable_expert_parallel", None),
              gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None))
    requests = requests or _requests(args, llm)
    counted = weight_bytes(llm.engine.parts.model)
    info = {"device": str(llm.engine.parts.selection.device), "quantized_lm_head": quantized_head,
            "loaded_weight_bytes": counted.total, "streamed_weight_bytes": counted.streamed}
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
              for r in requests]
    llm.generate([warm_up_prompt(requests[0])], SamplingParams(max_tokens=2, detokenize=False))  # untimed
    selection = llm.engine.parts.selection
    probe = _bracket_probe(args, selection.device)
    if times_in_chunks(probe, getattr(args, "probe_every", 0), requests):
        numbers = _probed_generate(llm, requests[0], params[0], probe, args.probe_every)
    else:
        numbers = bracketed_run(partial(_timed_generate, llm, requests, params), probe)
    peaks = peak_rss_bytes(os.getpid()) if peak_from_here else None
    # the benchmark process's peak since this engine began loading (None where the peak cannot be reset)
    numbers["peak_rss_bytes"] = peaks["process"] if peaks else None
    del llm
    gc.collect()  # the next configuration or baseline loads its own copy of the weights
    selection.adapter.empty_cache(selection.device)  # and sizes its KV cache from what is free
    return numbers, info, requests


def _timed_generate(llm: Any, requests: list[BenchRequest], params: list[Any]) -> dict[str, float]:
    """One timed run over the requests; every run starts with an empty prefix cache, so a repeat
    computes the prompts an earlier run cached (its hit rate, recorded, counts hits within the run)."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    numbers = engine_numbers(outputs, elapsed, out_tokens, sum(len(r.prompt_token_ids) for r in requests))
    numbers["prefix_cache_hit_rate"] = llm.engine.block_manager.prefix_cache_hit_rate
    return numbers


def _probed_generate(llm: Any, request: BenchRequest, params: Any, probe: Probe,
                     every: int) -> dict[str, Any]:
    """_timed_generate's record for one request, timed by repeats.probed_decode."""
    llm.reset_prefix_cache()
    run = probed_decode(_engine_tokens(llm.engine, request.prompt_token_ids, params), request.output_len - 1,
                        probe, every)
    return {**chunked_record(run, len(request.prompt_token_ids)),
            "prefix_cache_hit_rate": llm.engine.block_manager.prefix_cache_hit_rate}


def _engine_tokens(engine: Any, prompt_token_ids: list[int], params: Any) -> Iterator[int]:
    """Step `engine` over one request as LLM.generate steps it, yielding each token as it comes (the
    first after the prefill); the request is aborted if the caller stops early."""
    request_id = engine.add_request(prompt_token_ids, params)
    have = 0
    try:
        while engine.has_unfinished():
            for output in engine.step():
                tokens = output.outputs[0].token_ids
                yield from tokens[have:]
                have = len(tokens)
    finally:
        engine.abort(request_id)  # a no-op once it finished


def _rate_key(args: argparse.Namespace) -> str:
    """The number a run is ranked by: the decode rate in latency mode, output tokens/s otherwise."""
    return "decode_tokens_per_s" if args.mode == "latency" else "output_tokens_per_s"


def _bracket_probe(args: argparse.Namespace, device: Any) -> Probe | None:
    """The probe that brackets each timed latency run (see bench/repeats.py), where --roofline asked
    for ceilings and the device's plan brackets its runs; None otherwise."""
    from flashllm.bench import roofline as rl

    plan = rl.plan_for(device)
    if not (args.roofline and args.mode == "latency" and plan.bracket_runs):
        return None
    return rl.held_ceiling_probe(device, plan)  # its buffers allocated now, freed with the run's probe


def _transformers_round(args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest],
                        device: str) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    """One round of transformers `generate` on the same weights and device: a run of each static
    batch size (an out-of-memory size is recorded as {"batch_size", "error"}), and in latency mode
    one batch-1 latency run, bracketed by probes where _bracket_probe says so."""
    import torch

    from flashllm.bench.hf_baseline import free_cached_memory, load, run_batch_sizes

    model = load(model_dir, getattr(torch, args.dtype), device)
    batches = run_batch_sizes(model, requests, args.baseline_batch_sizes)
    latency = None
    if args.mode == "latency":  # between probes as flashllm's runs are, so its fraction is alike
        latency = bracketed_run(partial(_hf_latency, model, requests[0]), _bracket_probe(args, device))
    model_device = model.device
    del model
    free_cached_memory(model_device)  # the next engine, or the roofline's 2 GiB buffers, come next
    return batches, latency


def _hf_latency(model: Any, request: BenchRequest) -> dict[str, float]:
    from flashllm.bench.hf_baseline import run_latency

    run = run_latency(model, request)
    return {"ttft_s": run.ttft, "decode_tokens_per_s": run.decode_tokens_per_s}


def _transformers_record(args: argparse.Namespace, rounds: list[tuple[list[dict[str, Any]], dict[str, float] | None]],
                         flash: list[dict[str, Any]], result: dict[str, Any]) -> None:
    """The transformers records (each batch size's median run) and flashllm's speedups over them,
    within each round: over that round's best batch size that ran (None where none ran)."""
    result["transformers"] = []
    for i in range(len(args.baseline_batch_sizes)):
        runs = [batches[i] for batches, _ in rounds]
        failed = [run for run in runs if "error" in run]
        result["transformers"].append(failed[0] if failed else median_run(runs, "output_tokens_per_s"))
    best = [max((r["output_tokens_per_s"] for r in batches if "error" not in r), default=None) for batches, _ in rounds]
    result["speedup_vs_best_transformers"] = (None if None in best else paired_ratio(
        flash, [{"output_tokens_per_s": b} for b in best], "output_tokens_per_s"))
    if args.mode == "latency":
        latency = [run for _, run in rounds]
        result["transformers_latency"] = median_run(latency, "decode_tokens_per_s")
        result["transformers_streamed_bytes"] = _transformers_streamed_bytes(Path(result["model"]), args.dtype)
        result["decode_speedup_vs_transformers"] = paired_ratio(flash, latency, "decode_tokens_per_s")


def _transformers_streamed_bytes(model_dir: Path, dtype: str) -> int:
    """What transformers' batch-1 decode step reads: the active matmul parameters as floats (a MoE
    model's routed experts only); for a GGUF file, which has no config.json to count from, its size."""
    import torch

    from flashllm.bench.shapes import active_parameter_bytes, parameter_bytes

    if model_dir.is_file():
        return parameter_bytes(model_dir)
    return active_parameter_bytes(model_dir, getattr(torch, dtype).itemsize)


def _gemm_probe(dtype: Any, device: str) -> float:
    """A GEMM probe between rounds (see _roofline); a seam the tests replace."""
    from flashllm.bench import roofline as rl

    return rl.measure_ceiling_matmul(dtype, device)


def _roofline(args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest], result: dict[str, Any],
              dtype: Any, gemm_probes: list[float]) -> None:
    """The machine's ceilings measured now, and every result as a fraction of its own ceiling.

    Batch-1 decode is bandwidth-bound: ceiling = bandwidth / weight bytes read per step (the
    quantized bytes when weights are quantized; an input embedding table counts only when a float
    LM head is that table: see WeightBytes.streamed). A whole offline run is at best compute-bound:
    ceiling = matmul FLOP/s / FLOPs per token, with FLOPs per token = 2 x matmul parameters +
    attention at the workload's mean context (docs/benchmarks.md).
    """
    from flashllm.bench import roofline as rl
    from flashllm.bench.shapes import flops_per_token

    roof = rl.measure(dtype, result["device"])
    # the compute ceiling takes the best GEMM probe of the benchmark: the one after all rounds alone
    # once caught a slow phase of the shared host and put an offline run at 1.22 of its "ceiling"
    gemm_probes = [*gemm_probes, roof.matmul_flops]
    roof = dataclasses.replace(roof, matmul_flops=max(gemm_probes))
    result["roofline"] = {"read_bandwidth_gb_s": roof.read_bandwidth / 1e9,
                          "copy_bandwidth_gb_s": roof.copy_bandwidth / 1e9,
                          "matmul_gflop_s": roof.matmul_flops / 1e9,
                          "matmul_probes_gflop_s": [flops / 1e9 for flops in gemm_probes],
                          "ceiling_bandwidth": roof.ceiling,
                          "read_probes_gb_s": {name: rate / 1e9 for name, rate in roof.read_probes}}
    # from this probe (best of `repeats`): the reference line of a throughput run and the ceiling of
    # latency runs that were not bracketed; bracketed runs divide by their own probes (bench/repeats.py)
    result["decode_ceiling_batch1_tokens_per_s"] = roof.decode_ceiling(1, result["streamed_weight_bytes"])
    mean_context = sum(len(r.prompt_token_ids) + r.output_len / 2 for r in requests) / len(requests)
    compute = roof.compute_ceiling(flops_per_token(model_dir, mean_context))
    result["compute_ceiling_tokens_per_s"] = compute
    result["fraction_of_compute_ceiling"] = {"flashllm": result["flashllm"]["total_tokens_per_s"] / compute}
    for run in result.get("transformers", []):
        if "error" not in run:
            result["fraction_of_compute_ceiling"][f"transformers_batch{run['batch_size']}"] = (
                run["total_tokens_per_s"] / compute)
    for run in result.get("llama.cpp", []):
        result["fraction_of_compute_ceiling"]["llama.cpp"] = run["total_tokens_per_s"] / compute
    if args.mode == "latency":
        for of, key in (("ceiling", "fractions_of_bandwidth_ceiling"), ("sustained", "fractions_of_sustained_bandwidth")):
            fractions = _latency_fractions(result, roof, of)
            if fractions:
                result[key] = fractions
            for run in result.get("quant_runs", []):
                fraction = _decode_fraction(run, run["streamed_weight_bytes"], roof, of)
                if fraction is not None:
                    run[FRACTIONS[of][1]] = fraction
        result["fraction_of_bandwidth_ceiling"] = result["fractions_of_bandwidth_ceiling"]["flashllm"]
        result["bandwidth_fraction_method"] = (
            "median over runs, each against the probes at its ends (at its chunks' ends with --probe-every): "
            "the higher fastest read; of the sustained read: the higher rate over all its reads"
            if "ceiling_bandwidth_gb_s" in result["flashllm"] else "against the roofline probe after all runs")


def _latency_fractions(result: dict[str, Any], roof: Any, of: str) -> dict[str, float]:
    """Each engine's batch-1 _decode_fraction (of="ceiling" or "sustained"), where it has one."""
    records = [("flashllm", result["flashllm"], result["streamed_weight_bytes"])]
    if "transformers_latency" in result:  # float weights, the parameters its step multiplies by
        records.append(("transformers", result["transformers_latency"], result["transformers_streamed_bytes"]))
    records += [("llama.cpp", run, run.get("gguf_streamed_bytes", run["gguf_bytes"])) for run in result.get("llama.cpp", [])]
    fractions = {name: _decode_fraction(record, streamed, roof, of) for name, record, streamed in records}
    return {name: fraction for name, fraction in fractions.items() if fraction is not None}


def _decode_fraction(record: dict[str, Any], streamed_bytes: int, roof: Any, of: str = "ceiling") -> float | None:
    """A batch-1 record's fraction of the bandwidth ceiling (or, of="sustained", of the sustained
    read): against the probes bracketing its own runs where it has them (bench/repeats.py); else,
    for the ceiling, against the roofline measured after all runs, and None for the sustained read."""
    paired = bandwidth_fraction(record, "decode_tokens_per_s", streamed_bytes, of)
    if paired is not None or of != "ceiling":
        return paired
    return record["decode_tokens_per_s"] / roof.decode_ceiling(1, streamed_bytes)


def max_model_len(requested: int | None, model_dir: Path) -> int:
    """The benchmark's context: what was asked, else 4096 capped by the model's max_position_embeddings."""
    if requested is not None:
        return requested
    from flashllm.models.hf_config import load_hf_config

    return min(4096, load_hf_config(model_dir).max_position_embeddings)


def _llama_cpp_ready(args: argparse.Namespace) -> None:
    """Throughput runs need a llama-server binary, latency runs llama-cpp-python; SystemExit in one line if absent."""
    from flashllm.bench.llamacpp_baseline import LlamaCppUnavailable, require_llama_cpp
    from flashllm.bench.llamacpp_server import LlamaServerUnavailable, find_llama_server

    try:
        if args.mode == "throughput":
            find_llama_server(getattr(args, "llama_server", None))
        else:
            require_llama_cpp()
    except (LlamaCppUnavailable, LlamaServerUnavailable) as exc:
        raise SystemExit(f"flashllm bench: --baseline llama.cpp: {exc}") from exc


def _llama_cpp(args: argparse.Namespace, model_dir: Path, requests: list[BenchRequest]) -> dict[str, Any]:
    """One llama.cpp run on a GGUF of the same weights: throughput through llama-server with one slot
    per sequence flashllm may run at once (min(--max-num-seqs, requests)); latency (batch 1) through
    llama-cpp-python, one request after another."""
    from flashllm.bench.gguf_export import GGUFExportError, cached_gguf
    from flashllm.bench.llamacpp_baseline import GGUF_TYPE_FOR_DTYPE, run_baseline

    file_type = args.gguf_type or GGUF_TYPE_FOR_DTYPE.get(args.dtype, "f32")
    try:
        if args.mode == "throughput":
            from flashllm.bench import llamacpp_server as ls
            from flashllm.bench.serve_compare import flashllm_threads, throughput_run

            binary, gguf = ls.find_llama_server(getattr(args, "llama_server", None)), cached_gguf(model_dir, file_type)
            slots = min(args.max_num_seqs, len(requests))
            record = throughput_run(binary, gguf, requests, slots, flashllm_threads(), args.max_model_len,
                                       tuple(getattr(args, "llama_server_arg", None) or ()))
            record.update(gguf=str(gguf), gguf_type=file_type, n_threads=flashllm_threads(),
                          llama_server=str(binary), llama_server_version=ls.llama_server_version(binary))
        else:
            probe = _bracket_probe(args, "cpu")
            record = run_baseline(model_dir, requests, file_type, probe=probe,
                                  probe_every=getattr(args, "probe_every", 0))
    except GGUFExportError as exc:
        raise SystemExit(f"flashllm bench: --baseline llama.cpp: {exc}") from exc
    from flashllm.bench.gguf_moe import streamed_bytes

    record["gguf_bytes"] = Path(record["gguf"]).stat().st_size
    record["gguf_streamed_bytes"] = streamed_bytes(Path(record["gguf"]))  # a MoE file: the routed experts only
    return record


def _requests(args: argparse.Namespace, llm: Any) -> list[BenchRequest]:
    from flashllm.bench.workload import parse_range, random_requests, sharegpt_file_requests

    if args.dataset == "sharegpt":
        return sharegpt_file_requests(args, llm.tokenizer)
    vocab = llm.engine.parts.hf_config.vocab_size
    return random_requests(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab, args.seed)


def engine_numbers(outputs: list, elapsed: float, out_tokens: int, in_tokens: int) -> dict[str, float]:
    """Throughput and latency numbers of one flashllm run (decode rate only for a single request)."""
    numbers = {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
               "total_tokens_per_s": (out_tokens + in_tokens) / elapsed}
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    numbers["mean_ttft_s"] = sum(ttfts) / len(ttfts)
    if len(outputs) == 1:
        o = outputs[0]
        n = len(o.outputs[0].token_ids)
        numbers["decode_tokens_per_s"] = (n - 1) / (o.metrics.latency - o.metrics.time_to_first_token)
    return numbers
