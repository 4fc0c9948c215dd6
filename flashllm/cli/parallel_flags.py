"""--tensor-parallel-size and --distributed-executor-backend, declared once for every command that builds an engine."""

from __future__ import annotations

import argparse
from typing import Any

from flashllm.config import DISTRIBUTED_EXECUTOR_BACKENDS

# dest -> every spelling: kebab-case, the snake_case PaddleNLP and vLLM users type, and vLLM's -tp
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tensor-parallel-size", "--tensor_parallel_size", "-tp"),
    "distributed_executor_backend": ("--distributed-executor-backend", "--distributed_executor_backend"),
}
HELP = {
    "tensor_parallel_size": "ranks the model's weights and KV cache are split over (default 1)",
    "distributed_executor_backend": "what runs the ranks: uniproc (this process, one rank) | mp (a process per rank "
                                    "on this machine) | ray (an actor per rank on a Ray cluster; the `ray` extra) | "
                                    "external (ranks launched by torchrun); default: uniproc for one rank, external "
                                    "under torchrun, else mp",
}


def tensor_parallel_size(text: str) -> int:
    """Parse --tensor-parallel-size: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--tensor-parallel-size must be a whole number of at least 1 (the ranks "
                                         f"the model is split over), got {text!r}")
    return value


def executor_backend(text: str) -> str:
    """Parse --distributed-executor-backend: one of uniproc, mp, ray, external."""
    if text not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise argparse.ArgumentTypeError(f"--distributed-executor-backend must be one of "
                                         f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {text!r}")
    return text


METAVARS = {"tensor_parallel_size": "N", "distributed_executor_backend": "{" + ",".join(DISTRIBUTED_EXECUTOR_BACKENDS) + "}"}
PARSERS = (("tensor_parallel_size", tensor_parallel_size), ("distributed_executor_backend", executor_backend))


EXPERT_PARALLEL_HELP = ("MoE layers hold whole experts per rank (experts / tensor-parallel-size each) instead of "
                        "every expert's slice (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3; docs/parallel.md)")


def add_parallel_flags(parser: Any, prefix: str = "", who: str = "", passed_on: bool = False) -> None:
    """Add both flags to an argparse parser or argument group.

    prefix ("baseline-") names a second engine's copy of the flags (dest baseline_tensor_parallel_size,
    no -tp); who prefixes the help; passed_on: the flags go to another command (bench serve's
    server), so they default to None (not given) rather than to 1.
    """
    snake = prefix.replace("-", "_")
    suffix = " (passed to the started server)" if passed_on else ""
    for dest, parse in PARSERS:
        names = [f"--{prefix}{dest.replace('_', '-')}", f"--{snake}{dest}"]
        names += [] if prefix else list(FLAG_NAMES[dest][2:])  # -tp names the one engine of a command
        default = 1 if dest == "tensor_parallel_size" and not passed_on else None
        parser.add_argument(*names, dest=snake + dest, type=parse, default=default, metavar=METAVARS[dest],
                            help=who + HELP[dest] + suffix)
    parser.add_argument(f"--{prefix}enable-expert-parallel", f"--{snake}enable_expert_parallel",
                        dest=snake + "enable_expert_parallel", action="store_true", help=who + EXPERT_PARALLEL_HELP + suffix)


def parallel_options(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The parsed flags as LLM / engine_config keywords."""
    options = {dest: getattr(args, prefix + dest) for dest in FLAG_NAMES}
    options["enable_expert_parallel"] = getattr(args, prefix + "enable_expert_parallel", False)
    return options
