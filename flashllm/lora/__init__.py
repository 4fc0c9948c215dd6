"""LoRA adapters: PEFT-format reading, merging at load, and batched multi-adapter serving."""

from __future__ import annotations

from flashllm.lora.manager import LoRAManager, LoRARequest
from flashllm.lora.peft import LoRAAdapter, LoRAError, LoRAWeights, load_adapter, read_adapter_config

__all__ = ["LoRAAdapter", "LoRAError", "LoRAManager", "LoRARequest", "LoRAWeights", "load_adapter",
           "read_adapter_config"]
