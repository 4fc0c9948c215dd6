"""Tests' way to build flashllm's model for a checkpoint directory without an engine: the built-in families'
registry and the reference backend's ops unless a test passes its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashllm.backends.reference import reference_op_table
from flashllm.models.builtin import flashllm_register_models
from flashllm.models.loader import load_model
from flashllm.models.registry import ModelRegistry


def builtin_registry() -> ModelRegistry:
    """A registry holding every family flashllm ships (what the engine's start-up registers)."""
    registry = ModelRegistry()
    flashllm_register_models(registry.register)
    return registry


def load_flashllm(model_dir: str | Path, ops: Any = None, dtype: torch.dtype = torch.float32,
                  **kwargs: Any) -> torch.nn.Module:
    """model_dir -> flashllm's model on the CPU in `dtype`, its ops the reference backend's unless `ops` is given;
    kwargs go to load_model (tp_rank, tp_size, quant, ...)."""
    ops = reference_op_table() if ops is None else ops
    return load_model(model_dir, ops, dtype, "cpu", builtin_registry(), progress=False, **kwargs)[0]
