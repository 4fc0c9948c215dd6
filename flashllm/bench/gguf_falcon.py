"""GGUF export of Falcon checkpoints (FalconForCausalLM: Falcon-7B / 40B / 180B, Falcon2-11B) as llama.cpp's converter
writes `falcon` files: `transformer.word_embeddings` / `ln_f` / `lm_head` as token_embd / output_norm / output (none
where tied), each layer's fused `self_attention.query_key_value` as `attn_qkv` with its rows regrouped from the key /
value groups ([the group's q heads | k | v]) into all q rows, then all k, then all v, `self_attention.dense` as
attn_output, the MLP's dense_h_to_4h / dense_4h_to_h as ffn_up / ffn_down, `input_layernorm` (one norm) or `ln_mlp` as
attn_norm and `ln_attn` as attn_norm_2, the LayerNorms' eps as `attention.layer_norm_epsilon`, the key / value heads as
`attention.head_count_kv`. Beyond the converter, the RoPE base is written (`rope.freq_base`; the converter leaves
llama.cpp's default 10000). Refused, as llama.cpp's falcon graph would run them otherwise: ALiBi (Falcon-RW), the
sequential block, biases, an activation other than GELU (its graph runs GELU, tanh-approximated: a "gelu" checkpoint
exports as the converter writes it, and runs so), an MLP other than 4 x hidden (the converter's feed_forward_length),
rope scaling, and a config whose key / value heads the converter reads otherwise (num_kv_heads, else 1);
flashllm.models.gguf.falcon says how a file runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ARCHITECTURE = "FalconForCausalLM"
LAYER_NAMES = {"self_attention.query_key_value": "attn_qkv", "self_attention.dense": "attn_output",
               "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down", "ln_mlp": "attn_norm",
               "ln_attn": "attn_norm_2"}
_GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# checkpoint prefix -> the Llama-style name gguf_export maps
_RENAMED = {"transformer.word_embeddings.": "model.embed_tokens.", "transformer.ln_f.": "model.norm.",
            "transformer.h.": "model.layers."}

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check(config: Any) -> None:
    """ValueError for what llama.cpp's falcon loader or graph would run differently (module docstring)."""
    raw = config.raw
    if config.alibi:
        raise ValueError("Falcon with alibi (Falcon-RW) has no GGUF export: llama.cpp's falcon graph always runs RoPE")
    if not config.parallel_attn:
        raise ValueError("Falcon with parallel_attn=false has no GGUF export: llama.cpp's falcon graph always runs the "
                         "parallel block")
    if config.attention_bias:
        raise ValueError("Falcon with bias=true has no GGUF export: llama.cpp's falcon loader reads no biases")
    if config.hidden_act not in _GELUS:
        raise ValueError(f"Falcon with activation={config.hidden_act!r} has no GGUF export: llama.cpp's falcon graph "
                         "always runs GELU")
    if config.intermediate_size != 4 * config.hidden_size:
        raise ValueError(f"Falcon with ffn_hidden_size={config.intermediate_size} has no GGUF export: the converter "
                         f"writes a feed_forward_length of 4 x hidden_size ({4 * config.hidden_size})")
    if config.rope_scaling is not None:
        raise ValueError("Falcon with rope scaling has no GGUF export: the converter writes none")
    converter_kv = raw.get("num_kv_heads", raw.get("n_head_kv")) or 1
    if converter_kv != config.num_key_value_heads:
        raise ValueError(f"Falcon with {config.num_key_value_heads} key / value heads has no GGUF export: the "
                         f"converter reads {converter_kv} (num_kv_heads, else 1) and regroups attn_qkv by that")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps under the key llama.cpp's falcon loader reads, and the converter's qkv layout mark."""
    writer.add_layer_norm_eps(config.rms_norm_eps)
    writer.add_tensor_data_layout("jploski")


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's (HF name, shape, loader) entries under names gguf_export maps, the fused q / k / v rows
    regrouped as the converter regroups them (all q, all k, all v)."""
    groups, head_dim = config.num_key_value_heads, config.head_dim
    for name, shape, load in entries:
        for old, new in _RENAMED.items():
            if name.startswith(old):
                name = new + name[len(old):]
        yield name, shape, (regrouped_qkv(load, groups, head_dim) if ".query_key_value." in name else load)


def regrouped_qkv(load: Callable[[], np.ndarray], groups: int, head_dim: int) -> Callable[[], np.ndarray]:
    """(groups x [the group's q heads | k | v] x head_dim, ...) rows -> (all q heads | all k | all v, ...)."""
    def grouped() -> np.ndarray:
        rows = load()
        rest = rows.shape[1:]
        per_group = rows.reshape(groups, -1, head_dim, *rest)  # (groups, q heads + 2, head_dim, ...)
        parts = (per_group[:, :-2], per_group[:, -2:-1], per_group[:, -1:])
        return np.concatenate([part.reshape(-1, *rest) for part in parts])

    return grouped
