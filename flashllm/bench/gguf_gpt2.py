"""GGUF export of GPT-2 (GPT2LMHeadModel) and GPTBigCode (GPTBigCodeForCausalLM: StarCoder 1, SantaCoder)
checkpoints as llama.cpp's converter writes `gpt2` and `starcoder` files: `wte` / `wpe` / `ln_f` as token_embd /
position_embd / output_norm, each layer's ln_1 / ln_2 as attn_norm / ffn_norm, the fused `attn.c_attn` as attn_qkv
(rows [q | k | v] as the checkpoint holds them), attn.c_proj as attn_output, the MLP's c_fc / c_proj as ffn_up /
ffn_down, every bias beside its weight, GPT-2's Conv1D weights transposed into linear layout, the causal-mask buffers
left out, no output tensor where the head is tied, and the LayerNorms' eps as `attention.layer_norm_epsilon`.
Beyond the converter, `feed_forward_length` is the MLP's real width (the converter writes 4 x n_embd whatever n_inner
says, a file llama.cpp could not load for another width). Refused: what llama.cpp's one graph for both would run
differently: scores not scaled by head_size ** -0.5 (scale_attn_weights=false, GPT-2's
scale_attn_by_inverse_layer_idx), an activation other than tanh-approximated GELU, and GPTBigCode's multi-head
layout (multi_query=false: c_attn's rows go head by head, while the converter writes them unchanged with one key /
value head); flashllm.models.gguf.gpt2 says how a file runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

GPT2_ARCHITECTURE, BIGCODE_ARCHITECTURE = "GPT2LMHeadModel", "GPTBigCodeForCausalLM"
LAYER_NAMES = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# checkpoint prefix -> the Llama-style name gguf_export maps (model.embed_positions: position_embd)
_RENAMED = {"transformer.wte.": "model.embed_tokens.", "transformer.wpe.": "model.embed_positions.",
            "transformer.ln_f.": "model.norm.", "transformer.h.": "model.layers."}
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # the causal mask older checkpoints keep: llama.cpp has none
_CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # GPT-2's, stored (in, out)

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def _check_common(config: Any, family: str) -> None:
    if not config.raw.get("scale_attn_weights", True):
        raise ValueError(f"{family} with scale_attn_weights=false has no GGUF export: llama.cpp's graph scales scores "
                         "by head_size ** -0.5")
    if config.hidden_act not in _TANH_GELUS:
        raise ValueError(f"{family} with activation_function={config.hidden_act!r} has no GGUF export: llama.cpp's "
                         "graph always runs tanh-approximated GELU")


def check_gpt2(config: Any) -> None:
    """ValueError for what llama.cpp's gpt2 graph would run differently (module docstring)."""
    _check_common(config, "GPT-2")
    if config.raw.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx has no GGUF export: llama.cpp's gpt2 graph "
                         "scales every layer's scores alike")


def check_bigcode(config: Any) -> None:
    """ValueError for what llama.cpp's starcoder graph would run differently (module docstring)."""
    _check_common(config, "GPTBigCode")
    if config.num_key_value_heads != 1:
        raise ValueError("GPTBigCode with multi_query=false has no GGUF export: the converter writes its head-by-head "
                         "c_attn rows unchanged with one key / value head, which llama.cpp would misread")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps under the key llama.cpp's gpt2 / starcoder loaders read."""
    writer.add_layer_norm_eps(config.rms_norm_eps)


def transform_gpt2(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """GPT-2's entries with `transformer.` put before names without it (the original gpt2 files) and each Conv1D
    weight transposed into linear layout, as the converter does; transform then renames them."""
    for name, shape, load in entries:
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"
        if name.endswith(_CONV1D_WEIGHTS) and len(shape) == 2:
            shape, load = shape[::-1], _transposed(load)
        yield name, shape, load


def transform_bigcode(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's (HF name, shape, loader) entries under names gguf_export maps, buffers left out."""
    for name, shape, load in entries:
        if name.endswith(_BUFFERS):
            continue
        for old, new in _RENAMED.items():
            if name.startswith(old):
                name = new + name[len(old):]
        yield name, shape, load


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """GPT-2's entries: transform_gpt2, then transform_bigcode."""
    return transform_bigcode(list(transform_gpt2(entries, config)), config)


def _transposed(load: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(load().T)
