"""Helium (`HeliumForCausalLM`: kyutai/helium-1-2b and its preview), as transformers' HeliumConfig /
HeliumForCausalLM read and run it: Llama's decoder with RoPE over adjacent feature pairs (2i, 2i + 1), not halves;
biases on q / k / v where `attention_bias` but never on the output projection, which maps hidden_size to hidden_size
(so num_attention_heads x head_dim must be hidden_size); MLP biases where `mlp_bias`; HeliumConfig's defaults
(head_dim 128, rope_theta 100000, rms_norm_eps 1e-8, ...) for omitted fields.

Every module is Llama's, so the fused decoder-stack path stays offered. In half precision transformers multiplies the
RMSNorm scale in fp32 and casts RoPE's cos / sin to the model dtype first: a rounding apart from flashllm's ops,
within their tolerances."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flashllm.models.errors import ModelLoadError
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized

# transformers' HeliumConfig defaults (Helium-1 2B's shape) where config.json leaves a field out (Llama's differ)
HELIUM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 48000, "hidden_size": 2560, "intermediate_size": 7040, "num_hidden_layers": 24,
    "num_attention_heads": 20, "num_key_value_heads": 20, "head_dim": 128, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-8, "rope_theta": 100000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "attention_bias": False, "mlp_bias": False,
}


def parse_helium_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig with HeliumConfig's defaults, adjacent-pair RoPE and no sliding window; a
    pre-quantized checkpoint is refused (quantize at load with --quant_type). Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    given = {**HELIUM_DEFAULTS, **raw}
    config = parse_llama_config(given | {"sliding_window": None}, source)
    if config.num_attention_heads * config.head_dim != config.hidden_size:
        raise ModelLoadError(f"{source}: num_attention_heads={config.num_attention_heads} x head_dim="
                             f"{config.head_dim} is not hidden_size={config.hidden_size}; Helium's output projection "
                             "maps hidden_size to hidden_size")
    return dataclasses.replace(config, rope_interleaved=True, raw=raw)


class HeliumForCausalLM(LlamaForCausalLM):
    """Helium (module docstring): Llama's model and checkpoint names."""

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_helium_config)."""
        return parse_helium_config(raw, source)

    @staticmethod
    def attention_biases(config: LlamaModelConfig) -> tuple[bool, bool]:
        """`attention_bias` on q / k / v only: HeliumAttention's o_proj has none."""
        return config.attention_bias, False
