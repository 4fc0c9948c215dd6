"""Qwen-VL language-model GGUF files (`qwen2vl`: Qwen2-VL and Qwen2.5-VL; `qwen3vl`: Qwen3-VL dense): run text-only
as flashllm's Qwen2ForCausalLM and Qwen3ForCausalLM, their multimodal RoPE read as plain (NEOX) RoPE.

What llama.cpp does with them (src/models/qwen2vl.cpp and qwen3vl.cpp, the converter's Qwen2VLModel and
Qwen3VLTextModel; the vision tower goes to a separate mmproj file, never this one): Qwen2's tensors (q / k / v
biases, no q / k norms) for `qwen2vl`, Qwen3's (per-head `attn_q_norm` / `attn_k_norm` before RoPE, no biases) for
`qwen3vl`, Q/K rows as in the checkpoint, and `ggml_rope_multi` over the whole head with `<arch>.rope.dimension_sections`
(the checkpoint's mrope_section padded to four: time, height, width, extra): contiguous sections (MROPE) for
`qwen2vl`, interleaved ones (IMROPE: pair p of each section cycle takes time, height, width by p % 3 while within three
times that section) for `qwen3vl`. A text token's position is (p, p, p, 0): every pair that a time, height or width
section covers turns by p with the frequency its pair index gives, which is NEOX RoPE; a pair left to the extra
section turns by 0. Contiguous sections with a non-zero fourth one (no converter writes them) are refused. Interleaved
sections are run as transformers' Qwen3-VL runs text, every pair turned by p: its interleaving gives a pair that no
height or width span claims to time. The published Qwen3-VL files ([24, 20, 20] over 64 pairs) leave pairs 61 and 62
to llama.cpp's extra position, so llama.cpp turns those two (the slowest: with the 5e6 base, about 4e-7 rad per
position) by 0 on text where transformers and flashllm turn them by p, a difference of a few hundredths of a radian
on those two pairs at 100k positions.

`qwen3vl.n_deepstack_layers` sizes the embedding input llama.cpp accepts from an image encoder
(hidden * (1 + n) wide); a token's embedding is the `token_embd` row (hidden wide) padded with zeros, so the deepstack
slices the graph adds to the first n layers' outputs are zero for text and the decoder is Qwen3's.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

QWEN2VL = "qwen2vl"
QWEN3VL = "qwen3vl"


def plain_rope_pairs(sections: list[int], pairs: int, interleaved: bool) -> list[int]:
    """The rotary pairs (of `pairs`) that ggml's multimodal RoPE with these four sections leaves to the extra
    position (0 for a text token); empty where it equals NEOX RoPE on text (module docstring)."""
    span = sum(sections)
    left = []
    for pair in range(pairs):
        sector = pair % span
        if interleaved:
            covered = any(sector % 3 == axis and sector < 3 * sections[axis] for axis in range(3))
        else:
            covered = sector < sum(sections[:3])
        if not covered:
            left.append(pair)
    return left


def _sections(gf: GGUFFile, arch: str, head_dim: int) -> list[int]:
    """`<arch>.rope.dimension_sections` checked: four sections; contiguous ones (qwen2vl) turning every pair of a
    text token as NEOX RoPE does (module docstring)."""
    key = f"{arch}.rope.dimension_sections"
    found = gf.get(key)
    values = [int(v) for v in found] if isinstance(found, list) else []
    if len(values) != 4 or min(values) < 0 or sum(values[:3]) <= 0 or sum(values) > head_dim // 2:
        raise ModelLoadError(f"{gf.name}: {key} is {values or None}; llama.cpp's {arch} graph needs four non-negative "
                             f"multimodal RoPE sections of at most {head_dim // 2} pairs in all")
    left = [] if arch == QWEN3VL else plain_rope_pairs(values, head_dim // 2, interleaved=False)
    if left:
        raise ModelLoadError(f"{gf.name}: {key} {values} leaves rotary pairs {left} to the extra position, which "
                             f"llama.cpp turns by 0 for text; flashllm runs {arch} text as plain RoPE only")
    return values


def _head_dim(raw: dict[str, Any]) -> int:
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def qwen2vl_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Qwen2ForCausalLM config.json fields of a `qwen2vl` file (module docstring): Qwen2's, sections checked."""
    _sections(gf, QWEN2VL, _head_dim(raw))
    return {}


def qwen3vl_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3ForCausalLM config.json fields of a `qwen3vl` file (module docstring): Qwen3's, sections checked."""
    _sections(gf, QWEN3VL, _head_dim(raw))
    deepstack = gf.get(f"{QWEN3VL}.n_deepstack_layers", 0)
    if isinstance(deepstack, bool) or not isinstance(deepstack, int) or not 0 <= deepstack <= raw["num_hidden_layers"]:
        raise ModelLoadError(f"{gf.name}: {QWEN3VL}.n_deepstack_layers is {deepstack!r}; expected a layer count")
    if "blk.0.attn_q_norm.weight" not in gf.tensors:
        raise ModelLoadError(f"{gf.name} has no blk.0.attn_q_norm.weight; llama.cpp's {QWEN3VL} graph norms every "
                             "query and key head, so the file is incomplete")
    return {}
