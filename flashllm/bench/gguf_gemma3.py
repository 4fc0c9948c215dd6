"""GGUF export of Gemma 3 text checkpoints (Gemma3ForCausalLM) and Gemma 2 ones (Gemma2ForCausalLM, `gemma2` files) as
llama.cpp's converter writes them: norms as 1 + w, Gemma's tensor names, the sliding window (and Gemma 2's two caps);
configs llama.cpp's gemma3 / gemma2 rules would run differently are refused.

The rules (which layers slide, the sliding layers' RoPE base, the attention scale) are llama.cpp's hard-coded ones,
kept in flashllm.models.gguf.gemma3 next to the loader that reads them back.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.gguf import gemma3 as rules

ARCHITECTURE, GEMMA2_ARCHITECTURE = "Gemma3ForCausalLM", "Gemma2ForCausalLM"
NORM_SHIFT = rules.NORM_OFFSET  # convert_hf_to_gguf adds 1 to every Gemma `*norm.weight`
# HF module names (after the layer index) whose GGUF names differ from Llama's (the sandwich norms)
LAYER_NAMES = {hf: gguf_name for gguf_name, hf in rules.LAYER_NAMES.items()}


class Gemma3ExportError(ValueError):
    """The Gemma 3 config cannot be written as a GGUF llama.cpp runs the same way; the message says why."""


def check(config: Any) -> None:
    """Refuse what llama.cpp's gemma3 loader would derive differently from the checkpoint's config."""
    layers = config.num_hidden_layers
    sliding = any(w is not None for w in config.sliding_windows)
    expected = [t == "sliding_attention" for t in rules.layer_types(layers, sliding)]
    if [w is not None for w in config.sliding_windows] != expected:
        raise Gemma3ExportError(f"sliding layers {_indices(config.sliding_windows, True)} of {layers}: llama.cpp's "
                                f"gemma3 slides layer i when i % {rules.SLIDING_PATTERN} < {rules.SLIDING_PATTERN - 1} "
                                "(sliding_window_pattern 6) or none; this model has no GGUF export")
    if len({w for w in config.sliding_windows if w is not None}) > 1:
        raise Gemma3ExportError("sliding layers of different windows have no GGUF export (one sliding_window key)")
    scalar = rules.attention_scalar(layers, config.hidden_size, config.num_attention_heads, config.head_dim)
    if config.query_pre_attn_scalar != scalar:
        raise Gemma3ExportError(f"query_pre_attn_scalar={config.query_pre_attn_scalar:g}: llama.cpp's gemma3 derives "
                                f"{scalar} for this shape (head_dim, or hidden_size // heads at 62 layers) and GGUF "
                                "does not store it; this model has no GGUF export")
    if sliding and (config.local_rope_theta != rules.LOCAL_ROPE_THETA or config.local_rope_scaling is not None):
        raise Gemma3ExportError(f"sliding layers' RoPE base {config.local_rope_theta:g} (scaling "
                                f"{config.local_rope_scaling}): llama.cpp's gemma3 hard-codes {rules.LOCAL_ROPE_THETA:g}, "
                                "unscaled; this model has no GGUF export")
    if sliding and config.final_logit_softcapping is not None:
        raise Gemma3ExportError("final_logit_softcapping with sliding layers: llama.cpp's gemma3 graph for such files "
                                "ignores the cap; this model has no GGUF export")
    if config.attention_bias:
        raise Gemma3ExportError("attention_bias=true: llama.cpp's gemma3 graph adds no attention biases")


def add_hparams(writer: Any, config: Any) -> None:
    """The sliding window (when any layer slides) and the logit cap (when set), as the converter writes them."""
    window = next((w for w in config.sliding_windows if w is not None), None)
    if window is not None:
        writer.add_sliding_window(window)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def check_gemma2(config: Any) -> None:
    """ValueError for what llama.cpp's gemma2 rules would run differently from the checkpoint's config."""
    layers = config.num_hidden_layers
    if [w is not None for w in config.sliding_windows] != [t == "sliding_attention"
                                                            for t in rules.gemma2_layer_types(layers)]:
        raise Gemma3ExportError(f"sliding layers {_indices(config.sliding_windows, True)} of {layers}: llama.cpp's "
                                "gemma2 slides the even layers; this model has no GGUF export")
    if len({w for w in config.sliding_windows if w is not None}) > 1:
        raise Gemma3ExportError("sliding layers of different windows have no GGUF export (one sliding_window key)")
    scalar = rules.attention_scalar(layers, config.hidden_size, config.num_attention_heads, config.head_dim,
                                    rules.GEMMA2_LAYERS_OF_27B)
    if config.query_pre_attn_scalar != scalar:
        raise Gemma3ExportError(f"query_pre_attn_scalar={config.query_pre_attn_scalar:g}: llama.cpp's gemma2 derives "
                                f"{scalar} for this shape and GGUF does not store it; this model has no GGUF export")
    if config.attn_logit_softcapping is None or config.final_logit_softcapping is None:
        raise Gemma3ExportError("Gemma 2 without a score or logit cap: llama.cpp's gemma2 graph always caps (50 / 30 "
                                "when the file has no value); this model has no GGUF export")
    if config.attention_bias or config.rope_scaling is not None:
        raise Gemma3ExportError("attention_bias or rope scaling: llama.cpp's gemma2 graph has neither")


def add_gemma2_hparams(writer: Any, config: Any) -> None:
    """The window and the two caps, as the converter writes a Gemma 2's."""
    writer.add_sliding_window(next((w for w in config.sliding_windows if w is not None), rules.GEMMA2_WINDOW))
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _indices(windows: tuple[int | None, ...], sliding: bool) -> list[int]:
    return [i for i, w in enumerate(windows) if (w is not None) == sliding]
