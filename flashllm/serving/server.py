"""Build the engine and app from resolved options and run uvicorn with draining and fatal-error exits."""

from __future__ import annotations

import functools
import logging
import resource
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from flashllm.config import CPU_SERVE_MAX_PREFILL_TOKENS, SpeculativeConfigError, speculative_flags_config
from flashllm.core.builder import EngineConfigError
from flashllm.core.engine import Engine
from flashllm.llm import engine_config
from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
from flashllm.models.chat_template import ChatTemplate
from flashllm.models.default_model import is_demo_model
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.pooling_config import read_pooling
from flashllm.models.tokenizer import load_chat_template
from flashllm.sampling_params import SamplingParams
from flashllm.serving.app import create_app
from flashllm.serving.async_engine import AsyncEngine, StepEngine
from flashllm.serving.connection import ConnectionLimits, GuardedH11Protocol
from flashllm.serving.generation import ServerContext
from flashllm.serving.metrics import ServerMetrics

logger = logging.getLogger("flashllm.serve")

DEMO_MODEL_NAME = "flashllm-demo"
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_HEADER_BYTES = 64 << 10
MAX_TEMPLATE_FILE_BYTES = 1 << 20
# After the drain timeout, how long the cut-off requests get to send their 503 before uvicorn stops.
CUT_OFF_GRACE_S = 2.0


@dataclass
class BuiltServer:
    app: FastAPI
    ctx: ServerContext
    engine: AsyncEngine
    limits: ConnectionLimits


@dataclass
class ServedModel:
    """A loaded model as the server sees it, whichever engine (paged or static graph) runs it."""

    engine: Engine | StepEngine
    tokenizer: Any
    model_dir: Path
    max_model_len: int
    vocab_size: int
    defaults: SamplingParams
    info: dict[str, Any] = field(default_factory=dict)  # extra /v1/models fields


def build_server(options: dict[str, Any]) -> BuiltServer:
    """Load the model, start the engine thread and build the app (the model loads before binding).

    A model or cache configuration that cannot work exits with one line naming the problem
    (e.g. a KV cache too small for one max_model_len sequence), not a traceback.
    """
    limits = connection_limits(options)
    if not 0 < options["engine_stall_warning"] < float("inf"):
        raise SystemExit(f"flashllm serve: --engine-stall-warning must be a positive number of seconds, "
                         f"got {options['engine_stall_warning']}")
    try:
        served = _load_static(options) if options.get("mode") == "static" else _load_dynamic(options)
    except (EngineConfigError, ModelLoadError, SpeculativeConfigError) as exc:
        raise SystemExit(f"flashllm serve: {exc}") from None
    names = options["served_model_name"] or [Path(options["model"] or served.model_dir).resolve().name
                                             if options["model"] or not is_demo_model(served.model_dir)
                                             else DEMO_MODEL_NAME]
    if isinstance(names, str):
        names = [names]
    name = names[0]
    async_engine = AsyncEngine(served.engine, options["max_queue"], stall_warning_s=options["engine_stall_warning"])
    ctx = ServerContext(
        engine=async_engine, tokenizer=served.tokenizer, model_name=name, max_model_len=served.max_model_len,
        defaults={k: getattr(served.defaults, k) for k in SAMPLING_DEFAULT_KEYS},
        request_timeout=options["request_timeout"],
        metrics=ServerMetrics(name, lambda: async_engine.stats, limits,
                              lambda: (async_engine.seconds_since_step(), async_engine.num_stalls)),
        chat_template=_chat_template(served, options["chat_template"]),
        vocab_size=served.vocab_size, model_info=served.info,
        allow_special_tokens_in_content=options["allow_special_tokens_in_content"],
        model_aliases=tuple(names[1:]),
        reasoning_parser=options.get("reasoning_parser"),
        structured_output_in_reasoning=options.get("structured_output_in_reasoning", False),
        tool_call_parser=options.get("tool_call_parser") or "hermes",
        scheduling_policy=options.get("scheduling_policy") or "fcfs",
    )
    if options.get("mode") != "static":
        _embedding_setup(ctx, served)
    app = create_app(ctx, options["api_key"] or (), options["max_body_bytes"])
    if options.get("enable_lora"):
        _serve_loras(options, served.engine, ctx, app)
    if options["ui"]:
        from flashllm.serving.webui import mount_webui

        if options["api_key"]:
            logger.warning("--ui with --api-key: the /ui page needs the key too (send it as a bearer header)")
        base = f"http://{_client_host(options['host'])}:{options['port']}/v1"
        mount_webui(app, base, name, (options["api_key"] or [None])[0])
    return BuiltServer(app, ctx, async_engine, limits)


def _serve_loras(options: dict[str, Any], engine: Any, ctx: ServerContext, app: Any) -> None:
    """--lora-modules loaded now (one-line exit on a bad adapter) and the admin endpoints (serving/lora_api.py)."""
    from flashllm.lora import LoRAError
    from flashllm.serving.lora_api import LoRARoutes, parse_lora_modules

    routes = LoRARoutes(ctx, bool(options["api_key"]), options["allowed_lora_dir"] or ())
    try:
        routes.register_startup(engine, parse_lora_modules(options["lora_modules"] or ()))
    except (LoRAError, ValueError) as exc:
        raise SystemExit(f"flashllm serve: {exc}") from None
    routes.install(app)


def connection_limits(options: dict[str, Any]) -> ConnectionLimits:
    """The connection layer's limits from the serve options (one-line exit on a bad value)."""
    try:
        limits = ConnectionLimits(header_timeout=options["header_timeout"], body_timeout=options["body_timeout"],
                                  keep_alive_timeout=options["keep_alive_timeout"],
                                  max_connections=options["max_connections"])
    except ValueError as exc:
        raise SystemExit(f"flashllm serve: {exc}") from None
    _raise_open_files_limit(limits.max_connections)
    return limits


def _raise_open_files_limit(max_connections: int) -> None:
    """Each connection is a file descriptor: lift the soft limit toward the hard one, or warn."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + 256  # model files, the listening socket, logs, the engine's own
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            logger.warning("--max-connections %d needs about %d open files but the hard limit is %d; "
                           "lower --max-connections or raise `ulimit -Hn`", max_connections, needed, hard)


def _embedding_setup(ctx: ServerContext, served: ServedModel) -> None:
    """/v1/embeddings' pooling from the model directory; a configuration flashllm cannot compute disables the
    route (each request says why) rather than the server."""
    try:
        ctx.pooling = read_pooling(served.model_dir)
    except ModelLoadError as exc:
        ctx.pooling_error = str(exc)
    ctx.embedding_size = served.engine.parts.hf_config.hidden_size


def _load_dynamic(options: dict[str, Any]) -> ServedModel:
    engine = _build_engine(options)
    return ServedModel(engine, engine.tokenizer, engine.parts.model_dir, engine.max_model_len,
                       engine.parts.hf_config.vocab_size, engine.default_sampling_params())


def _build_engine(options: dict[str, Any]) -> Engine:
    config = engine_config(
        options["model"], tokenizer=options.get("tokenizer"), dtype=options["dtype"], device=options["device"],
        backend=options["backend"],
        max_model_len=options["max_model_len"], block_size=options["block_size"],
        num_kv_blocks=options["num_kv_blocks"], kv_cache_memory=options["kv_cache_memory"],
        kv_cache_dtype=options["kv_cache_dtype"], cachekv_int8_type=options["cachekv_int8_type"],
        max_num_seqs=options["max_num_seqs"], max_num_batched_tokens=options["max_num_batched_tokens"],
        max_prefill_tokens=options.get("max_prefill_tokens"), num_scheduler_steps=options["num_scheduler_steps"], enable_prefix_caching=not options["no_prefix_caching"],
        scheduling_policy=options.get("scheduling_policy") or "fcfs",
        strict_kernels=options["strict_kernels"],
        enforce_eager=options["enforce_eager"], gpu_memory_utilization=options["gpu_memory_utilization"],
        seed=options["seed"], tensor_parallel_size=options["tensor_parallel_size"],
        distributed_executor_backend=options["distributed_executor_backend"],
        enable_expert_parallel=bool(options.get("enable_expert_parallel")), lora_path=options["lora_path"],
        enable_lora=options["enable_lora"], max_loras=options["max_loras"], max_lora_rank=options["max_lora_rank"],
        max_cpu_loras=options["max_cpu_loras"], quant_type=options.get("quant_type", "none"),
        group_size=options.get("weightonly_group_size", -1), moe_quant_type=options.get("moe_quant_type"),
        quantize_lm_head=bool(options.get("quantize_lm_head")),
        mla_use_matrix_absorption=options.get("mla_use_matrix_absorption", True),
        speculative_config=speculative_flags_config(options.get),
    )
    engine = Engine(config)
    runner = getattr(engine, "runner", None)
    if options.get("max_prefill_tokens") is None and runner is not None and runner.device.type == "cpu":
        config.scheduler.max_prefill_tokens = CPU_SERVE_MAX_PREFILL_TOKENS  # the scheduler reads it each step
    return engine


def _load_static(options: dict[str, Any]) -> ServedModel:
    """StaticLLM's engine over an export: one batch at a time (no continuous batching)."""
    from flashllm.static.runner import StaticLLM

    if options["model"] is None:
        raise ModelLoadError("--mode static needs the directory written by `flashllm export MODEL --format onnx "
                             "--output DIR`; pass it as the model")
    if options["max_num_seqs"] < 1:
        raise ModelLoadError(f"--max-num-seqs must be at least 1, got {options['max_num_seqs']}")
    llm = StaticLLM(options["model"], device=options["device"], dtype=options["dtype"],
                    max_model_len=options["max_model_len"], max_num_seqs=options["max_num_seqs"], seed=options["seed"])
    info = {"mode": "static", "execution_provider": llm.graph.provider,
            "batching": f"one batch of up to {llm.max_num_seqs} sequences at a time; requests that arrive while "
                        "a batch decodes wait until it finishes (no continuous batching)"}
    return ServedModel(llm.engine, llm.tokenizer, llm.model_dir, llm.max_model_len, llm.manifest.vocab_size,
                       llm.default_sampling_params(), info)


def _chat_template(served: ServedModel, choice: str | None) -> ChatTemplate | None:
    if choice is None:
        return load_chat_template(served.model_dir) if served.tokenizer is not None else None
    if choice in BUILTIN_TEMPLATES:
        return load_chat_template(served.model_dir, choice)
    path = Path(choice)
    if not path.is_file() or path.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
        raise SystemExit(f"flashllm serve: --chat-template {choice!r} is neither a built-in template "
                         f"({', '.join(BUILTIN_TEMPLATES)}) nor a readable .jinja file under 1 MiB")
    return ChatTemplate(path.read_text(encoding="utf-8"), name=path.stem)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class _DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: refuse new work (503), let requests in flight finish, then exit.

    A second signal exits at once. The drain runs in a thread because it waits on the engine.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._drain_started = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_started:
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        logger.warning("signal %s: draining %d request(s) for up to %g s", signal.Signals(sig).name,
                       self.engine.num_in_flight, self.drain_timeout)
        self.engine.draining = True
        threading.Thread(target=self._drain, name="flashllm-drain", daemon=True).start()

    def _drain(self) -> None:
        if not self.engine.wait_idle(self.drain_timeout):
            # Tell the unfinished requests (503, or an error event on a stream) instead of letting
            # uvicorn drop their connections mid-response.
            count = self.engine.cut_off()
            logger.warning("drain timeout: %d request(s) still in flight are cut off with 503", count)
            self.engine.wait_idle(CUT_OFF_GRACE_S)
        self.should_exit = True


def uvicorn_config(built: BuiltServer, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for a built server: the guarded connection layer, its limits, no access log."""
    # uvicorn's own h11 protocol has no read deadlines and no connection cap; this subclass adds them
    protocol = functools.partial(GuardedH11Protocol, limits=built.limits)
    return uvicorn.Config(built.app, host=host, port=port, log_level="warning",
                          http=protocol, h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # type: ignore[arg-type]
                          timeout_keep_alive=built.limits.keep_alive_timeout,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=5, access_log=False)


def serve(built: BuiltServer, options: dict[str, Any]) -> int:
    """Run until drained (exit 0) or until the engine fails (exit 1).

    A drain timeout that cuts requests off still exits 0: the stop was asked for and the timeout
    is the operator's bound (the log counts the cut-off requests). Non-zero is kept for a failed
    engine, where a supervisor should restart the server.
    """
    config = uvicorn_config(built, options["host"], options["port"])
    server = _DrainingServer(config, built.engine, options["shutdown_drain_timeout"])

    def stop_serving(exc: BaseException) -> None:
        # Give the failed requests a moment to receive their errors, then stop serving.
        threading.Timer(0.5, lambda: setattr(server, "should_exit", True)).start()

    built.engine.on_fatal = stop_serving
    built.engine.start()
    info = built.ctx.model_info
    how = f" (static graph on onnxruntime's {info['execution_provider']})" if info.get("mode") == "static" else ""
    print(f"flashllm: serving {built.ctx.model_name!r}{how} on http://{options['host']}:{options['port']}/v1",
          flush=True)
    try:
        server.run()
    finally:
        built.engine.stop()
    if built.engine.error is not None:
        logger.error("exiting with status 1 because the engine failed: %s", built.engine.error)
        return 1
    return 0
