"""GGUF export of GPT-NeoX checkpoints (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B) as llama.cpp's converter writes
`gptneox` files: `gpt_neox.embed_in` / `final_layer_norm` / `embed_out` as token_embd / output_norm / output, each
layer's fused `attention.query_key_value` as `attn_qkv` with its rows regrouped from head-by-head [q | k | v] triples
into all q rows, then all k, then all v (weight and bias), `attention.dense` as attn_output, the MLP's dense_h_to_4h /
dense_4h_to_h as ffn_up / ffn_down, the LayerNorms' eps as `attention.layer_norm_epsilon` and `use_parallel_residual`
(true where config.json leaves it out). Beyond the converter, the RoPE base is written (`rope.freq_base`; the converter
leaves llama.cpp's default 10000). Refused: checkpoints without attention biases (attention_bias=false) or with a tied
head, which llama.cpp's gptneox loader does not accept, and an activation other than GELU (its graph always runs
GELU, tanh-approximated: a "gelu" checkpoint exports as the converter writes it, and runs so);
flashllm.models.gguf.gptneox says how a file runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ARCHITECTURE = "GPTNeoXForCausalLM"
LAYER_NAMES = {"attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
               "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
_GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# checkpoint prefix -> the Llama-style name gguf_export maps
_RENAMED = {"gpt_neox.embed_in.": "model.embed_tokens.", "gpt_neox.final_layer_norm.": "model.norm.",
            "gpt_neox.layers.": "model.layers.", "embed_out.": "lm_head."}
# buffers older checkpoints keep (the causal mask, the rope table): llama.cpp has none
_BUFFERS = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check(config: Any) -> None:
    """ValueError for what llama.cpp's gptneox loader or graph would run differently (module docstring)."""
    if not config.attention_bias:
        raise ValueError("GPT-NeoX with attention_bias=false has no GGUF export: llama.cpp's gptneox loader requires "
                         "the attn_qkv and attn_output biases")
    if config.tie_word_embeddings:
        raise ValueError("GPT-NeoX with tie_word_embeddings has no GGUF export: llama.cpp's gptneox loader requires "
                         "its own output.weight")
    if config.hidden_act not in _GELUS:
        raise ValueError(f"GPT-NeoX with hidden_act={config.hidden_act!r} has no GGUF export: llama.cpp's gptneox "
                         "graph always runs GELU")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps and the residual layout under the keys llama.cpp's gptneox loader reads."""
    writer.add_layer_norm_eps(config.rms_norm_eps)
    writer.add_parallel_residual(bool(config.raw.get("use_parallel_residual", True)))


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's (HF name, shape, loader) entries under names gguf_export maps, the fused q / k / v rows
    regrouped as the converter regroups them (all q, all k, all v), buffers left out."""
    heads = config.num_attention_heads
    for name, shape, load in entries:
        if name.endswith(_BUFFERS):
            continue
        for old, new in _RENAMED.items():
            if name.startswith(old):
                name = new + name[len(old):]
        yield name, shape, (_grouped(load, heads) if ".attention.query_key_value." in name else load)


def _grouped(load: Callable[[], np.ndarray], heads: int) -> Callable[[], np.ndarray]:
    """(heads x [q | k | v] x head_dim, ...) rows -> ([q | k | v] x heads x head_dim, ...)."""
    def grouped() -> np.ndarray:
        rows = load()
        per_head = rows.reshape(heads, 3, rows.shape[0] // (3 * heads), *rows.shape[1:])
        return np.ascontiguousarray(per_head.swapaxes(0, 1)).reshape(rows.shape)

    return grouped
