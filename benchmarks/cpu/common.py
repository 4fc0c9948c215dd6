"""What the CPU harnesses beside this file share: the qwen2.5-0.5b shape's product sizes, native
builds loaded with the package's signatures (with a control arm), an engine set up for one
greedy request, and the engine A/B's rounds over builds."""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from flashllm import LLM, SamplingParams
from flashllm.bench.shapes import SHAPES, shape_model_dir
from flashllm.bench.workload import BenchRequest, random_requests, warm_up_prompt

SHAPE = "qwen2.5-0.5b"
CONFIG = SHAPES[SHAPE]


def token_products() -> list[tuple[int, int]]:
    """(out, in) features of one token's products, in the engine's order: per layer fused qkv,
    o_proj, fused gate_up, down; then the LM head."""
    h, inter, heads, kv_heads = (CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                    "num_key_value_heads"))
    qkv = h + 2 * kv_heads * (h // heads)
    return [(qkv, h), (h, h), (2 * inter, h), (h, inter)] * CONFIG["num_hidden_layers"] + [(CONFIG["vocab_size"], h)]


def load_library(path: str) -> ctypes.CDLL:
    """A build of flashllm/backends/cpu/csrc with the argument types the package gives its own."""
    from flashllm.backends.cpu import native

    lib = ctypes.CDLL(path)
    for name, (argtypes, restype) in native._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The builds a harness compares (NAME=path, the first the baseline) and --no-control."""
    parser.add_argument("libs", nargs="+", help="NAME=path/to/lib.so; the first is the baseline")
    parser.add_argument("--no-control", action="store_true", help="no control arm (a copy of the first library)")


def load_builds(args: argparse.Namespace) -> dict[str, ctypes.CDLL]:
    """The builds of add_build_arguments, loaded in order, and unless --no-control a copy of the
    first as one more build, "<NAME>-copy": what the harness reports for no change. On a shared
    2-vCPU VM one 14-round engine_ab.py run measured two identical builds 1.056x apart (10 of 14),
    so a ratio within a few percent of 1 is not a result until the control sits near 1.000x."""
    builds = dict(spec.split("=", 1) for spec in args.libs)
    libs = {name: load_library(path) for name, path in builds.items()}
    if not args.no_control:
        name, path = next(iter(builds.items()))
        with tempfile.TemporaryDirectory() as scratch:  # another path, so ctypes loads a library of its own
            libs[f"{name}-copy"] = load_library(str(shutil.copyfile(path, Path(scratch) / "control.so")))
    return libs


def greedy_engine(tokens: int, prompt: int = 128) -> tuple[LLM, BenchRequest, SamplingParams]:
    """The shape's fp32 engine on the CPU, warmed up, with one request of a `prompt`-token prompt
    and `tokens` greedy output tokens (EOS ignored)."""
    llm = LLM(str(shape_model_dir(SHAPE, "float32")), device="cpu", max_model_len=4096)
    (request,) = random_requests(1, (prompt, prompt), (tokens, tokens), CONFIG["vocab_size"], 0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm.generate([warm_up_prompt(request)], SamplingParams(max_tokens=2, detokenize=False))
    return llm, request, params


def engine_rounds(libs: dict[str, ctypes.CDLL], rounds: int, outputs: Callable[[], list], timed: Callable[[], float],
                  unit: str) -> None:
    """An engine A/B over builds: each build's `outputs()` must equal the first's (said if not); then
    `rounds` rounds, each timing `timed()` once per build in a rotating order, and per build the
    median of its per-round ratios against the first build and the rounds it was faster in."""
    from flashllm.backends.cpu import native

    names = list(libs)
    first = None
    for name, lib in libs.items():
        native._state["lib"] = lib  # native.library() hands every later call this build
        got = outputs()
        first = got if first is None else first
        if got != first:
            print(f"{name}: outputs differ from {names[0]}'s")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            native._state["lib"] = libs[name]
            time.sleep(0.02)  # another library's workers stop spinning (thread_pool.h: ~5 ms)
            rates[name].append(timed())
        print(r, "  ".join(f"{name} {v[-1]:.2f} {unit}" for name, v in rates.items()), flush=True)
    for name, v in rates.items():
        ratios = [a / b for a, b in zip(v, rates[names[0]], strict=True)]
        print(f"{name}: {statistics.median(ratios):.3f}x {names[0]}, faster in {sum(x > 1 for x in ratios)} of {len(ratios)}")
