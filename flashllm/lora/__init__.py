"""LoRA adapters: PEFT-format reading, merging at load, and batched multi-adapter serving."""

from __future__ import annotations

from flashllm.lora.peft import LoRAAdapter, LoRAError, LoRAWeights, load_adapter, read_adapter_config

__all__ = ["LoRAAdapter", "LoRAError", "LoRAWeights", "load_adapter", "read_adapter_config"]
