"""GGUF export of gpt-oss checkpoints (GptOssForCausalLM) as llama.cpp's converter writes them (`gpt-oss` files): the
sinks as `attn_sinks`, the router as `ffn_gate_inp`, transformers' interleaved gate_up_proj (E, H, 2I) split into
the gate and up stacks (E, I, H) with their biases, down_proj transposed to (E, H, I), the norm before the MoE
branch as `post_attention_norm`; the window, expert counts and YaRN as metadata.

llama.cpp rounds YaRN's correction range (transformers' `truncate: true`) and hard-codes the activation's 1.702 and
7.0, so a checkpoint with `truncate: false` (the published config.json's) is refused: the file would not run as
the checkpoint does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flashllm.bench.gguf_arcee import add_yarn

ARCHITECTURE = "GptOssForCausalLM"
# HF module -> GGUF layer part, where gpt-oss's differ from Llama's
LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"}
_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_LAYER = re.compile(r"^(model\.layers\.\d+)\.(self_attn\.sinks|mlp\.router\.(weight|bias))$")
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check(config: Any) -> None:
    """Refuse what llama.cpp's gpt-oss graph would run differently (see the module docstring)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn" or scaling.get("truncate", True) is not True:
        raise ValueError("gpt-oss GGUF export needs YaRN with truncate=true: llama.cpp rounds the correction range, "
                         f"so rope_scaling {scaling!r} would run differently from the checkpoint")
    windows = config.sliding_windows
    if any(w != (windows[0] if i % 2 == 0 else None) for i, w in enumerate(windows)) or windows[0] is None:
        raise ValueError("gpt-oss GGUF export needs sliding windows on the even layers only, one size (llama.cpp's "
                         f"swa pattern of 2); got {windows}")


def add_hparams(writer: Any, config: Any) -> None:
    """The window, expert counts and width, and YaRN's factor and original context, as the converter writes them."""
    writer.add_sliding_window(config.sliding_windows[0])
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    add_yarn(writer, config.rope_scaling)


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's entries under the names gguf_export maps to the converter's (module docstring)."""
    for name, shape, load in entries:
        experts, layer = _EXPERTS.match(name), _LAYER.match(name)
        if layer is not None:
            target = "self_attn.sinks.weight" if layer[3] is None else f"mlp.gate.{layer[3]}"
            yield f"{layer[1]}.{target}", shape, load
        elif experts is None:
            yield name, shape, load
        elif experts[2] == "down_proj":
            suffix = "bias" if experts[3] else "weight"
            yield (f"{experts[1]}.mlp.experts.down_proj.{suffix}", shape if experts[3] else _swapped(shape),
                   load if experts[3] else _transposed(load))
        else:
            yield from _gate_and_up(experts[1], shape, load, bias=bool(experts[3]))


def _gate_and_up(prefix: str, shape: tuple[int, ...], load: Callable[[], np.ndarray], bias: bool) -> Iterator[Entry]:
    """gate_up_proj (E, H, 2I) or its bias (E, 2I), gate and up interleaved, as the gate and the up stacks."""
    rows = (shape[0], shape[-1] // 2) if bias else (shape[0], shape[2] // 2, shape[1])
    suffix = "bias" if bias else "weight"
    for proj, start in (("gate_proj", 0), ("up_proj", 1)):
        yield f"{prefix}.mlp.experts.{proj}.{suffix}", rows, _every_other(load, start, bias)


def _swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[2], shape[1])


def _transposed(load: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(load().transpose(0, 2, 1))


def _every_other(load: Callable[[], np.ndarray], start: int, bias: bool) -> Callable[[], np.ndarray]:
    if bias:
        return lambda: np.ascontiguousarray(load()[:, start::2])
    return lambda: np.ascontiguousarray(load().transpose(0, 2, 1)[:, start::2])
