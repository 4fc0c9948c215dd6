"""Mistral decoder: Llama's layers with sliding-window attention on every layer (Mistral-7B v0.1)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flashllm.models.errors import ModelLoadError
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' MistralConfig default: a config.json without the `sliding_window` key attends over
# this many tokens (a key set to null means full attention, as in Mistral-7B v0.2 and later)
DEFAULT_SLIDING_WINDOW = 4096


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's decoder (GQA, RoPE, SwiGLU, no biases) whose layers attend over the last
    `sliding_window` tokens: a query at position p sees keys p - W < k <= p.

    The KV cache keeps every token (the window is a mask in paged_attention, so prefix caching
    and chunked prefill work unchanged); an explicit `head_dim` (Mistral-Nemo) is honoured.
    """

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig with sliding_windows set from `sliding_window`.

        `sliding_window`: a positive int (every layer), null (full attention) or absent
        (DEFAULT_SLIDING_WINDOW, transformers' default). Other fields as parse_llama_config;
        ModelLoadError (one line) on a window that is not a positive int or null.
        """
        config = parse_llama_config(raw, source)
        # Mistral windows every layer: Qwen2's use_sliding_window / max_window_layers do not apply
        window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive int or null")
        return dataclasses.replace(config, sliding_windows=(window,) * config.num_hidden_layers)
