"""The xpu backend: Intel GPUs through torch.xpu, running torch-native kernels (no vendor-specific ops).

torch.xpu ships inside torch (2.4+); nothing from Intel's extension is imported. Availability asks
torch.xpu, which answers False on builds without XPU support without initializing anything.
"""

from __future__ import annotations

from typing import Any

import torch

from flashllm.registry.backend import Availability, Backend, DeviceAdapter
from flashllm.registry.precision import DeviceProfile

_ALL_FLOAT = frozenset({torch.float32, torch.float16, torch.bfloat16})
_WEIGHT_ONLY = frozenset({"none", "w8a16", "w4a16"})

# torch.xpu.get_device_properties() reports `has_subgroup_matrix_multiply_accumulate` (the XMX
# matrix engines of Arc and Data Center GPU Max) and `has_bfloat16_conversions` (PyTorch XPU docs,
# torch.xpu.get_device_properties). Without XMX, half types run on the vector units: bf16 is
# converted, not native, so `--dtype auto` keeps fp16 there. Weight-only schemes run the portable
# dequantize-then-matmul path, which any device can execute.
XPU_PROFILES: tuple[DeviceProfile, ...] = (
    DeviceProfile("Intel GPU with XMX (Arc, Data Center GPU Max)", _ALL_FLOAT, _WEIGHT_ONLY),
    DeviceProfile(
        "Intel GPU without XMX (older integrated)", _ALL_FLOAT, _WEIGHT_ONLY, native_bf16=False,
        notes="no matrix engines: bf16 is converted, prefer float16",
    ),
)


def profile_for_properties(properties: Any) -> DeviceProfile:
    """The profile of an XPU from its torch.xpu device properties."""
    has_xmx = bool(getattr(properties, "has_subgroup_matrix_multiply_accumulate", False))
    return XPU_PROFILES[0] if has_xmx else XPU_PROFILES[1]


class XpuAdapter(DeviceAdapter):
    """torch.xpu device services; XCCL (torch.distributed's XPU backend, torch 2.7+) for tensor parallelism."""

    dist_backend = "xccl"

    def __init__(self) -> None:
        super().__init__("xpu")


class XpuBackend(Backend):
    """torch.xpu device adapter with torch-native kernels."""

    def is_available(self) -> Availability:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return False, f"this torch ({torch.__version__}) has no torch.xpu: torch >= 2.4 is needed"
        if not xpu.is_available():
            return False, (
                f"torch {torch.__version__} sees no Intel GPU: install the XPU build of torch "
                "(pip install torch --index-url https://download.pytorch.org/whl/xpu) and the Intel GPU driver"
            )
        return True, f"{xpu.device_count()} Intel GPU(s)"

    def device_count(self) -> int:
        return torch.xpu.device_count()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return profile_for_properties(torch.xpu.get_device_properties(device))

    def known_profiles(self) -> list[DeviceProfile]:
        return list(XPU_PROFILES)

    def adapter(self) -> DeviceAdapter:
        return XpuAdapter()


def make_backend() -> Backend:
    """Build the xpu backend with the torch-native kernels (registration touches no device)."""
    backend = XpuBackend(
        name="xpu",
        device_type="xpu",
        priority=90,
        description="Intel GPUs through torch.xpu; torch-native kernels",
        install_hint="the XPU build of torch: pip install torch --index-url https://download.pytorch.org/whl/xpu",
        proof="mapped",
    )
    from flashllm.backends.xpu import native

    native.register(backend)
    return backend
