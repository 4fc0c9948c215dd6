"""Merge one LoRA adapter into the base weights as they stream from the checkpoint (`--lora_path`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from flashllm.lora.peft import LoRAAdapter

__all__ = ["checkpoint_headers", "merge_lora"]


def checkpoint_headers(files: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """({tensor name: shape}, {tensor name: safetensors dtype string}) of the weight files; reads headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                view = f.get_slice(name)
                shapes[name], dtypes[name] = tuple(view.get_shape()), view.get_dtype()
    return shapes, dtypes


def merge_lora(tensors: Iterator[tuple[str, Any]], adapter: LoRAAdapter) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with W + scale * B @ A for each weight the adapter adapts.

    Adapted weights are read whole and merged in float32 (the weight loader converts to the model
    dtype and cuts this rank's shard); every other tensor passes through unread. Closing this
    generator closes `tensors`.
    """
    try:
        for name, tensor in tensors:
            weights = adapter.weights.get(name)
            if weights is None:
                yield name, tensor
                continue
            yield name, tensor.to(torch.float32) + weights.delta()
    finally:
        tensors.close()
