"""GGUF export of StableLM checkpoints (StableLmForCausalLM: StableLM 2, StableLM-3B-4E1T) as llama.cpp's converter
writes `stablelm` files: Llama's tensor names, the LayerNorms' biases beside their weights, each layer's per-head
q / k norm scales (`self_attn.q_layernorm.norms.H.weight`, StableLM 2 12B) stacked in head order into one (heads,
head_dim) `attn_q_norm` / `attn_k_norm`, no `ffn_norm` in a parallel-residual layer (the checkpoint has no
post_attention_layernorm there), the norms' eps as `attention.layer_norm_epsilon` and `use_parallel_residual` as the
converter writes it (true where config.json leaves it out; llama.cpp's graph reads the absence of ffn_norm instead).
Beyond the converter, the RoPE base is written (`rope.freq_base`; the converter leaves llama.cpp's default 10000).
Refused: a tied head (llama.cpp's stablelm loader requires output.weight); flashllm.models.gguf.stablelm says how a
file runs."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ARCHITECTURE = "StableLmForCausalLM"
_HEAD_NORM = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qk])_layernorm\.norms\.(\d+)\.weight$")

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check(config: Any) -> None:
    """ValueError for what llama.cpp's stablelm loader would not accept (module docstring)."""
    if config.tie_word_embeddings:
        raise ValueError("StableLM with tie_word_embeddings has no GGUF export: llama.cpp's stablelm loader requires "
                         "its own output.weight")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps and the converter's use_parallel_residual under the keys of llama.cpp's stablelm."""
    writer.add_layer_norm_eps(config.rms_norm_eps)
    writer.add_parallel_residual(bool(config.raw.get("use_parallel_residual", True)))


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's (HF name, shape, loader) entries with each layer's per-head q / k norm scales stacked into one
    `self_attn.{q,k}_norm.weight` of (heads, head_dim), after the other entries; ValueError where some head's is
    missing."""
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    norms: dict[tuple[str, str], dict[int, Entry]] = {}
    for entry in entries:
        match = _HEAD_NORM.match(entry[0])
        if match is None:
            yield entry
        else:
            norms.setdefault((match[1], match[2]), {})[int(match[3])] = entry
    for (prefix, kind), found in sorted(norms.items()):
        if sorted(found) != list(range(heads[kind])):
            raise ValueError(f"{prefix}.{kind}_layernorm holds the norms of heads {sorted(found)}; the config has "
                             f"{heads[kind]} {kind} heads")
        loads = [found[head][2] for head in range(heads[kind])]
        shape = (heads[kind], *found[0][1])
        yield f"{prefix}.{kind}_norm.weight", shape, (lambda loads=loads: np.stack([load() for load in loads]))
