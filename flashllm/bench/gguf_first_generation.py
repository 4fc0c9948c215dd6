"""GGUF export of first-generation Qwen (QWenLMHeadModel) and Baichuan (BaichuanForCausalLM) checkpoints as llama.cpp's
converter writes `qwen` and `baichuan` files (flashllm.models.gguf.first_generation says how llama.cpp runs them).

- QWen: its own tensor names mapped to llama.cpp's (c_attn -> attn_qkv with its bias, w1 -> ffn_up, w2 -> ffn_gate),
  Q/K rows as they are (the qwen graph rotates half-split pairs, as QWen does), `feed_forward_length` QWen's own
  intermediate_size (twice each projection's width). Refused: biases beyond c_attn's (no_bias false), partial rotary,
  and logn attention or dynamic NTK where the context reaches past seq_length (the graph has neither).
- Baichuan: W_pack split into q, k and v (gguf_export reorders the Q/K rows for the interleaved rope, as for llama).
  Refused: a layer count llama.cpp does not map to the directory's position encoding (32 layers rotate, 40 take
  ALiBi). Baichuan2's head is written with its rows normalized, as Baichuan's README has llama.cpp users do before
  converting, so that llama.cpp computes the model's logits (flashllm normalizes either way).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flashllm.models.gguf.first_generation import BAICHUAN_POSITIONS

QWEN, BAICHUAN = "QWenLMHeadModel", "BaichuanForCausalLM"
# QWen module (after "transformer.h.L.") -> GGUF layer part
QWEN_LAYER_NAMES = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                    "mlp.w1": "ffn_up", "mlp.w2": "ffn_gate", "mlp.c_proj": "ffn_down"}
_QWEN_TOP = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm"}
_W_PACK = re.compile(r"^(model\.layers\.\d+\.self_attn)\.W_pack\.weight$")
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check_qwen(config: Any) -> None:
    """ValueError for a QWen checkpoint llama.cpp's qwen graph would run differently (module docstring)."""
    if config.attention_bias or config.mlp_bias:
        raise ValueError("QWen with no_bias=false has no GGUF export here: llama.cpp's qwen graph adds only c_attn's "
                         "bias")
    if config.rotary_dim != config.head_dim:
        raise ValueError(f"QWen with rotary_pct < 1 ({config.rotary_dim} of {config.head_dim} features) has no GGUF "
                         "export here: the converter writes full-head rope")
    if (config.use_logn_attn or config.use_dynamic_ntk) and config.max_position_embeddings > config.seq_length:
        raise ValueError(f"QWen with logn attention / dynamic NTK past seq_length={config.seq_length} (context "
                         f"{config.max_position_embeddings}) has no GGUF export here: llama.cpp runs plain RoPE there")


def qwen_feed_forward_length(config: Any) -> int:
    """QWen's config.json intermediate_size (the converter writes it; flashllm's config holds each projection's half)."""
    return 2 * config.intermediate_size


def qwen_names(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """QWen's tensors under the Llama-shaped names gguf_export maps (transformer.h.L.* -> model.layers.L.*)."""
    for name, shape, load in entries:
        stem, _, suffix = name.rpartition(".")
        if stem in _QWEN_TOP:
            yield f"{_QWEN_TOP[stem]}.{suffix}", shape, load
        else:
            yield re.sub(r"^transformer\.h\.", "model.layers.", name), shape, load


def check_baichuan(config: Any) -> None:
    """ValueError where llama.cpp's baichuan graph would pick another position encoding than the directory's."""
    expected = BAICHUAN_POSITIONS.get(config.num_hidden_layers)
    if expected != config.position_embedding:
        raise ValueError(f"a {config.num_hidden_layers}-layer Baichuan using {config.position_embedding} has no GGUF "
                         f"export here: llama.cpp's baichuan graph runs {expected or 'no position encoding'} for it "
                         "(RoPE at 32 layers, ALiBi at 40)")


def split_w_pack(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """W_pack (3 * hidden, hidden) as the q, k and v projections; Baichuan2's head with its rows normalized."""
    for name, shape, load in entries:
        packed = _W_PACK.match(name)
        if packed is not None:
            rows = shape[0] // 3
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                yield f"{packed[1]}.{proj}.weight", (rows, shape[1]), _rows(load, slice(i * rows, (i + 1) * rows))
        elif name == "lm_head.weight" and config.norm_head:
            yield name, shape, _normalized(load)
        else:
            yield name, shape, load


def _rows(load: Callable[[], np.ndarray], rows: slice) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(load()[rows])


def _normalized(load: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    def normalized() -> np.ndarray:
        head = load()
        return head / np.maximum(np.linalg.norm(head, axis=-1, keepdims=True), np.float32(1e-12))

    return normalized
