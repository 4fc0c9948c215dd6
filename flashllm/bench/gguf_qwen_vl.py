"""GGUF export of the language model of Qwen-VL checkpoints (Qwen2VL / Qwen2_5_VL / Qwen3VLForConditionalGeneration)
as llama.cpp's converter writes `qwen2vl` and `qwen3vl` files: Qwen2's or Qwen3's tensors under Llama's names (the
language model's `model.language_model.` / `language_model.model.` prefixes dropped, the vision tower left to the
mmproj file), the checkpoint's mrope_section padded to four as `rope.dimension_sections`, and for Qwen3-VL the count
of deepstack layers. Refused: sections llama.cpp would not turn as plain RoPE on text
(flashllm.models.gguf.qwen_vl says how a file runs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flashllm.models.gguf.qwen_vl import QWEN3VL, plain_rope_pairs
from flashllm.models.text_only import LANGUAGE_PREFIXES, VISION_PREFIXES

QWEN2VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
QWEN3VL_ARCHITECTURE = "Qwen3VLForConditionalGeneration"


def sections(config: Any) -> list[int]:
    """The checkpoint's mrope_section padded with zeros to four (time, height, width, extra), as the converter writes
    it; ValueError where the checkpoint has none."""
    given = config.raw.get("mrope_section")
    if not isinstance(given, list) or not 1 <= len(given) <= 4:
        raise ValueError(f"{config.architecture} without an mrope_section of up to four sections has no GGUF export: "
                         "llama.cpp's converter writes it as rope.dimension_sections")
    return [int(s) for s in given] + [0] * (4 - len(given))


def _check(config: Any, interleaved: bool) -> None:
    if any(window is not None for window in config.sliding_windows):
        raise ValueError(f"{config.architecture} with sliding-window layers has no GGUF export: llama.cpp's graph "
                         "attends to everything")
    # interleaved sections (Qwen3-VL) are exported whatever they leave to llama.cpp's extra position: the converter
    # writes them so, and flashllm.models.gguf.qwen_vl runs such files as transformers does
    left = [] if interleaved else plain_rope_pairs(sections(config), config.head_dim // 2, interleaved)
    if left:
        raise ValueError(f"{config.architecture}: mrope_section {sections(config)} leaves rotary pairs {left} to "
                         "llama.cpp's extra position, which it turns by 0 for text; no GGUF export")


def check_qwen2vl(config: Any) -> None:
    """ValueError for what llama.cpp's qwen2vl graph would run differently on text (module docstring)."""
    _check(config, interleaved=False)


def check_qwen3vl(config: Any) -> None:
    """ValueError for what llama.cpp's qwen3vl graph would run differently on text (module docstring)."""
    _check(config, interleaved=True)


def add_hparams(writer: Any, config: Any) -> None:
    """The multimodal RoPE sections (and Qwen3-VL's deepstack layer count) under llama.cpp's keys."""
    writer.add_rope_dimension_sections(sections(config))
    if writer.arch == QWEN3VL:
        writer.add_num_deepstack_layers(int(config.raw.get("deepstack_layers", 0)))


def language_model(items: list[Any], config: Any) -> Iterator[Any]:
    """The language model's (name, shape, loader) entries under Qwen2's / Qwen3's names; the vision tower's skipped."""
    for name, shape, load in items:
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, ours in LANGUAGE_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        yield name, shape, load
