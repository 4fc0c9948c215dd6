"""The `flashllm` command: one module per subcommand, each with add_parser() and run()."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# subcommand -> module under flashllm.cli; modules are imported only when their command runs.
COMMANDS: dict[str, str] = {
    "devices": "devices",
    "generate": "generate",
    "predict": "predict",
    "bench": "bench",
    "serve": "serve",
    "run-batch": "run_batch",
    "chat": "chat",
    "webui": "webui",
    "eval": "eval",
    "quantize": "quantize",
    "export": "export",
}
# Exit status of a start-up the user can fix (bad flag, config, model file, missing extra), as argparse's.
USAGE_ERROR = 2
# Optional packages -> the pyproject extra that installs them, for the one-line hint a command
# gives instead of a ModuleNotFoundError traceback when its extra is missing.
EXTRA_OF_MODULE: dict[str, str] = {
    "fastapi": "serve", "uvicorn": "serve", "pydantic": "serve", "prometheus_client": "serve", "yaml": "serve",
    "h11": "serve", "gradio": "ui", "onnx": "onnx", "onnxruntime": "onnx", "onnxscript": "onnx",
    "matplotlib": "bench", "rouge_score": "bench", "ray": "ray", "triton": "cuda", "lm_eval": "lm-eval",
    "llama_cpp": "llamacpp", "gguf": "llamacpp", "llguidance": "structured",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashllm", description="LLM inference on any device.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS.values():
        module = importlib.import_module(f"{__name__}.{module_name}")
        module.add_parser(sub)
    return parser


# `flashllm serve`: torch's OpenMP threads sleep as soon as a parallel region ends (unless the user set
# OMP_WAIT_POLICY). By default they spin for a while, and on a CPU they then compete for the cores with
# the native kernels' own workers, which run every product between two torch ops: issue 48's c16
# workload in process (qwen2.5-0.5b fp32, epyc4-2c) spent 9 % of its samples spinning in libgomp, and
# its prefill steps took 21.4 s passive against 23.2 s. Only serve and run-batch (the server's engine): the
# variable must be set before torch loads, and commands that start llama.cpp's server (bench) must not hand it
# to that process.
OMP_PASSIVE_COMMANDS = ("serve", "run-batch")


def _command(argv: list[str]) -> str | None:
    """The subcommand word of argv (the first word that is neither an option nor --log-level's value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `flashllm` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if _command(argv) in OMP_PASSIVE_COMMANDS and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(f"{__name__}.{COMMANDS[args.command]}")
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"flashllm {args.command}: needs the {exc.name} package, which the `{extra}` extra installs: "
              f"pip install 'flashllm[{extra}]' (in a checkout: pip install -e '.[{extra}]')", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)  # a command's own one-line refusal ("flashllm serve: ...")
        return USAGE_ERROR
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        # A model directory or configuration the user can fix: one line, no traceback.
        print(f"flashllm {args.command}: {_one_line(exc)}", file=sys.stderr)
        return USAGE_ERROR


def _one_line(exc: Exception) -> str:
    from flashllm.registry.resolve import DeviceSelectionError

    if isinstance(exc, DeviceSelectionError):  # its first line names the missing piece; the rest lists every backend
        return str(exc).splitlines()[0] + " (`flashllm devices` lists every backend)"
    return str(exc)


def _is_user_error(exc: Exception) -> bool:
    from flashllm.config import SpeculativeConfigError
    from flashllm.core.builder import EngineConfigError
    from flashllm.models.chat_template import ChatTemplateError
    from flashllm.models.hf_config import ModelLoadError
    from flashllm.registry.resolve import DeviceSelectionError, PrecisionError

    return isinstance(exc, (ModelLoadError, EngineConfigError, ChatTemplateError, DeviceSelectionError, PrecisionError,
                            SpeculativeConfigError))

