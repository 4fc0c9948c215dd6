"""Set a loaded model up for multi-LoRA serving: slot tables on its linear layers and the adapter manager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashllm.lora.manager import LoRAManager
from flashllm.lora.merge import checkpoint_headers
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.lora import enable_lora, lora_layers, lora_target
from flashllm.models.loader import safetensors_files


def build_lora_manager(model: torch.nn.Module, model_dir: str | Path, ops: Any, dtype: torch.dtype,
                       device: torch.device, max_loras: int, max_lora_rank: int,
                       max_cpu_loras: int | None = None) -> LoRAManager:
    """Give `model`'s linear layers `max_loras` adapter slots of rank `max_lora_rank` and return their manager.

    Adapters are checked against the shapes in the checkpoint's safetensors headers (nothing is
    read). Under tensor parallelism each rank's tables hold its part of every adapter. Raises
    ModelLoadError for a model multi-LoRA cannot serve (GGUF).
    """
    if Path(model_dir).is_file():
        raise ModelLoadError(f"multi-LoRA needs a safetensors checkpoint directory; {model_dir} is a file")
    shapes, _ = checkpoint_headers(safetensors_files(model_dir))
    context = enable_lora(model, ops, max_loras, max_lora_rank, dtype)
    tables = [layer.lora for _, layer in lora_layers(model)]
    return LoRAManager(context, lambda name: lora_target(model, name), shapes, model.packed_modules_mapping,
                       max_loras, max_lora_rank, dtype, device, max_cpu_loras, tables)
