"""GGUF export of BLOOM checkpoints (BloomForCausalLM: BLOOM 560m..176B, BLOOMZ) as llama.cpp's converter writes
`bloom` files: `word_embeddings` / `word_embeddings_layernorm` / `ln_f` / `lm_head` (with or without the `transformer.`
prefix) as token_embd / token_embd_norm / output_norm / output, each layer's fused `self_attention.query_key_value`
weight and bias as `attn_qkv` with their rows regrouped from head-by-head [q | k | v] triples into all q rows, then all
k, then all v, `self_attention.dense` as attn_output, the MLP's dense_h_to_4h / dense_4h_to_h as ffn_up / ffn_down,
the LayerNorms' eps as `attention.layer_norm_epsilon`. One difference from the converter: a tied checkpoint is written
without `output` (llama.cpp then reads the embedding, as transformers does), where the converter writes a copy of the
embedding; flashllm.models.gguf.bloom loads both. Nothing is refused beyond what BLOOM's config parser refuses: BLOOM
has no layout llama.cpp's bloom graph runs otherwise (ALiBi with its slopes, the tanh GELU, biases everywhere)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flashllm.bench.gguf_falcon import regrouped_qkv

ARCHITECTURE = "BloomForCausalLM"
LAYER_NAMES = {"self_attention.query_key_value": "attn_qkv", "self_attention.dense": "attn_output",
               "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
# checkpoint prefix (after any `transformer.`) -> the Llama-style name gguf_export maps
_RENAMED = {"word_embeddings_layernorm.": "model.embed_tokens.norm.", "word_embeddings.": "model.embed_tokens.",
            "h.": "model.layers.", "ln_f.": "model.norm."}

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps under the key llama.cpp's bloom loader reads."""
    writer.add_layer_norm_eps(config.rms_norm_eps)


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's (HF name, shape, loader) entries under names gguf_export maps, the fused q / k / v rows (one
    group per head) regrouped as the converter regroups them (all q, all k, all v)."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    for name, shape, load in entries:
        name = name.removeprefix("transformer.")
        for old, new in _RENAMED.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, shape, (regrouped_qkv(load, heads, head_dim) if ".query_key_value." in name else load)
