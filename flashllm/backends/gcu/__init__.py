"""The gcu backend: Enflame GCUs through torch_gcu (a PrivateUse1 device "gcu"), torch-native kernels.

What we could cite (torch_gcu v2.10.0 release notes, github.com/EnflameTechnology/torch-gcu):
torch_gcu plugs into PyTorch as the PrivateUse1 backend, implements ATen operators, exposes
torch.gcu (devices, AMP through torch.gcu.amp, graphs through torch.gcu.GCUGraph) and an ECCL
distributed backend. We found no public documentation of LLM-specific fused ops (RMSNorm, RoPE,
paged attention) or of per-chip dtype support, so this backend maps no vendor op: its kernels are
the torch-native ones of xpu/native.py, which run on any device implementing the ATen ops, and its
profile claims only fp32/fp16 (AMP implies half precision; bf16 is not claimed until documented).
"""

from __future__ import annotations

import torch

from flashllm.backends.npu import import_vendor
from flashllm.registry.backend import Availability, Backend, DeviceAdapter
from flashllm.registry.precision import DeviceProfile

INSTALL_HINT = "install Enflame's torch_gcu wheel matching your torch (github.com/EnflameTechnology/torch-gcu) and the GCU driver"

GCU_PROFILES: tuple[DeviceProfile, ...] = (
    DeviceProfile(
        "Enflame GCU", frozenset({torch.float32, torch.float16}), frozenset({"none", "w8a16", "w4a16"}),
        native_bf16=False, notes="dtype support per chip undocumented publicly: fp32/fp16 claimed",
    ),
)


class GcuAdapter(DeviceAdapter):
    """torch.gcu device services; ECCL (the torch_gcu distributed backend) for tensor parallelism."""

    dist_backend = "eccl"

    def __init__(self) -> None:
        super().__init__("gcu")


class GcuBackend(Backend):
    """torch_gcu device adapter with torch-native kernels."""

    def is_available(self) -> Availability:
        torch_gcu, reason = import_vendor("torch_gcu", INSTALL_HINT)
        if torch_gcu is None:
            return False, reason
        gcu = getattr(torch, "gcu", None)
        if gcu is None or not gcu.is_available():
            return False, "torch_gcu imported but sees no GCU (driver missing or no visible device)"
        return True, f"{gcu.device_count()} GCU(s)"

    def device_count(self) -> int:
        return torch.gcu.device_count()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return GCU_PROFILES[0]

    def known_profiles(self) -> list[DeviceProfile]:
        return list(GCU_PROFILES)

    def adapter(self) -> DeviceAdapter:
        return GcuAdapter()


def make_backend() -> Backend:
    """Build the gcu backend with the torch-native kernels (no torch_gcu import)."""
    backend = GcuBackend(
        name="gcu",
        device_type="gcu",
        priority=90,
        description="Enflame GCUs through torch_gcu; torch-native kernels",
        install_hint=INSTALL_HINT,
        proof="mapped",
    )
    from flashllm.backends.xpu import native

    native.register(backend)
    return backend
