"""An example third-party plugin: one silu_and_mul kernel for the CPU, and a toy architecture (toy_model.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashllm import hookimpl
from flashllm.registry.backend import Backend, Caps
from flashllm.registry.precision import DeviceProfile


class ExampleBackend(Backend):
    """Claims the CPU above the built-in cpu backend, with a single kernel."""

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return DeviceProfile("example CPU", frozenset({torch.float32}))

    def known_profiles(self) -> list[DeviceProfile]:
        return [DeviceProfile("example CPU", frozenset({torch.float32}))]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@hookimpl
def flashllm_register_backends(register: Callable[[Backend], None]) -> None:
    backend = ExampleBackend(name="example", device_type="cpu", priority=50, description="example plugin")
    backend.kernel("silu_and_mul", Caps(dtypes=frozenset({torch.float32})))(silu_and_mul)
    register(backend)


@hookimpl
def flashllm_register_models(register: Callable[[str, Any], None]) -> None:
    """ToyGeluForCausalLM, lazily: its module loads when a checkpoint's config.json names it."""
    register("ToyGeluForCausalLM", "flashllm_example_backend.toy_model:ToyGeluForCausalLM")
