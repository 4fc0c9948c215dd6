"""The ggml backend: llama.cpp's CPU arithmetic in its order, so GGUF runs give llama.cpp's tokens (opt-in, slow)."""

from __future__ import annotations

import torch

from flashllm.backends.cpu import CpuAdapter
from flashllm.registry.backend import Availability, Backend, DeviceAdapter
from flashllm.registry.precision import DeviceProfile

# What llama.cpp's CPU backend computes with an fp32 KV cache and no flash attention, emulated in numpy
# (numerics.py): fp32 activations, GGUF blocks ("gguf") and float weights, an fp32 cache.
GGML_PROFILE = DeviceProfile(
    "CPU, llama.cpp's arithmetic (emulated)", frozenset({torch.float32}), frozenset({"none", "gguf"}), frozenset(),
    native_bf16=False, accelerator=False,
    notes="numpy emulation of ggml's x86 float order: agrees with llama.cpp token for token, decode ~40x slower than cpu",
)


class GgmlBackend(Backend):
    """Kernels that follow ggml's float operations in its order; chosen only by name (backend="ggml")."""

    def is_available(self) -> Availability:
        return True, "numpy emulation of ggml's x86 CPU arithmetic (for agreement with llama.cpp, not speed)"

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return GGML_PROFILE

    def known_profiles(self) -> list[DeviceProfile]:
        return [GGML_PROFILE]

    def adapter(self) -> DeviceAdapter:
        return CpuAdapter()


def make_backend() -> Backend:
    """Build the ggml backend. Its priority is below the cpu backend's: `auto` and `cpu` never pick it."""
    backend = GgmlBackend(
        name="ggml",
        device_type="cpu",
        priority=1,
        description="llama.cpp's CPU arithmetic in its order (numpy; slow): GGUF greedy tokens as llama.cpp's",
    )
    from flashllm.backends.ggml import kernels

    kernels.register(backend)
    return backend
