"""Seed-OSS (`SeedOssForCausalLM`, ByteDance-Seed/Seed-OSS-36B): Llama's decoder with biases on q, k and v
(`attention_bias`, default true) but on o only where `attention_out_bias` says (default false), and an explicit
head_dim (128 by default, not hidden / heads), as transformers' SeedOssConfig reads them. The stack is Llama's, so
the fused cpu decode step applies."""

from __future__ import annotations

from typing import Any

from flashllm.models.hf_config import flag
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' SeedOssConfig defaults where config.json leaves a field out
SEED_OSS_DEFAULTS: dict[str, Any] = {"attention_bias": True, "head_dim": 128, "rms_norm_eps": 1e-6}


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS: checkpoint names as Llama's (q/k/v and gate/up fused at load)."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig with Seed-OSS's defaults (see parse_llama_config for the rest)."""
        fields = {**SEED_OSS_DEFAULTS, **raw}
        config = parse_llama_config(fields, source)
        flag(raw, "attention_out_bias", source)  # validated here, read by attention_biases
        return config

    @staticmethod
    def attention_biases(config: LlamaModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): `attention_bias` and `attention_out_bias`."""
        return config.attention_bias, bool(config.raw.get("attention_out_bias", False))
