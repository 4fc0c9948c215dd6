"""Qwen2 / Qwen2.5 decoder: Llama's layers with a bias on the q, k and v projections."""

from __future__ import annotations

from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama's decoder with qkv bias (and no o_proj bias) whatever the config says.

    Everything else (tied embeddings of the small Qwen2.5 models, per-layer sliding windows
    from `use_sliding_window` / `max_window_layers`) comes from the parsed config.
    """

    @staticmethod
    def attention_biases(config: LlamaModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias) = (True, False) for every Qwen2 checkpoint."""
        return True, False
