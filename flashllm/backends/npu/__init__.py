"""The npu backend: Huawei Ascend NPUs through torch_npu, its fused LLM ops mapped to flashllm ops.

Importing this module imports no torch_npu: `is_available()` and the kernels import it on first
use (kernels.py), so registering the backend costs nothing on machines without an NPU.
Sources for every claim are the Ascend Extension for PyTorch API reference (torch_npu 7.0.0,
hiascend.com "ptaoplist" pages) unless a comment says otherwise.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from flashllm.registry.backend import Availability, Backend, DeviceAdapter
from flashllm.registry.precision import DeviceProfile

INSTALL_HINT = "pip install torch-npu (the Ascend CANN toolkit and NPU driver are required)"

_HALF = frozenset({torch.float32, torch.float16})
_BF16 = _HALF | {torch.bfloat16}

# Ascend generations by what torch_npu documents per product:
# - Atlas A2/A3 (Ascend 910B/910C): npu_incre_flash_attention / npu_fused_infer_attention_score take
#   float16 and bfloat16; npu_weight_quant_batchmatmul takes int8 and int4-in-int32 weights,
#   per-channel and per-group; npu_quant_matmul gives int8 x int8 GEMMs (a8w8, not mapped yet).
# - Atlas inference series (Ascend 310P): the same attention and weight-quant APIs "support only
#   FLOAT16" there, and weight-quant is int8 per-channel only (no per-group, no int4).
# - Atlas training series (Ascend 910, first generation): not listed among the supported products
#   of the attention and weight-quant APIs, so only fp16/fp32 through the generic ops is claimed.
NPU_PROFILES: tuple[tuple[str, DeviceProfile], ...] = (
    ("Ascend910B", DeviceProfile(
        "Ascend 910B/910C (Atlas A2/A3)", _BF16, frozenset({"none", "w8a16", "w4a16", "a8w8"}),
        frozenset({torch.int8}),
    )),
    ("Ascend910_93", DeviceProfile(  # the 910C reports itself as Ascend910_93xx
        "Ascend 910B/910C (Atlas A2/A3)", _BF16, frozenset({"none", "w8a16", "w4a16", "a8w8"}),
        frozenset({torch.int8}),
    )),
    ("Ascend310P", DeviceProfile(
        "Ascend 310P (Atlas inference series)", _HALF, frozenset({"none", "w8a16"}), frozenset({torch.int8}),
        native_bf16=False, notes="fused attention and weight-quant ops are float16-only here",
    )),
    ("Ascend910", DeviceProfile(
        "Ascend 910 (Atlas training series)", _HALF, frozenset({"none"}), native_bf16=False,
        notes="not a documented target of the fused inference ops",
    )),
)


def profile_for_name(device_name: str) -> DeviceProfile:
    """The precision profile of an NPU from torch.npu.get_device_name(), e.g. "Ascend910B3".

    Unknown names get the most conservative profile (Ascend 910 first generation).
    """
    for prefix, profile in NPU_PROFILES:
        if device_name.startswith(prefix):
            return profile
    return NPU_PROFILES[-1][1]


def import_vendor(module: str, install_hint: str) -> tuple[ModuleType | None, str]:
    """(module, "") when `module` imports, else (None, a reason naming what is missing)."""
    try:
        return importlib.import_module(module), ""
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None, f"{module} is not installed: {install_hint}"
        return None, f"{module} is installed but its dependency {exc.name} is missing: {install_hint}"
    except Exception as exc:  # a vendor package failing at import (no driver, bad env) is reported, not raised
        return None, f"{module} is installed but failed to import ({type(exc).__name__}: {exc}); check the vendor toolkit environment"


class NpuAdapter(DeviceAdapter):
    """torch.npu device services (registered by torch_npu); HCCL for tensor parallelism."""

    dist_backend = "hccl"
    cluster_resource = "NPU"

    def __init__(self) -> None:
        super().__init__("npu")


class NpuBackend(Backend):
    """torch_npu fused kernels for rms_norm, rotary, paged attention and weight-only matmuls."""

    def is_available(self) -> Availability:
        torch_npu, reason = import_vendor("torch_npu", INSTALL_HINT)
        if torch_npu is None:
            return False, reason
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return False, "torch_npu imported but sees no NPU (driver missing or ASCEND_RT_VISIBLE_DEVICES empty)"
        return True, f"{npu.device_count()} NPU(s), torch_npu {getattr(torch_npu, '__version__', 'unknown version')}"

    def device_count(self) -> int:
        return torch.npu.device_count()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return profile_for_name(torch.npu.get_device_name(device.index or 0))

    def known_profiles(self) -> list[DeviceProfile]:
        unique = {profile.name: profile for _, profile in NPU_PROFILES}
        return list(unique.values())

    def adapter(self) -> DeviceAdapter:
        return NpuAdapter()


def make_backend() -> Backend:
    """Build the npu backend and register its kernels (no torch_npu import)."""
    backend = NpuBackend(
        name="npu",
        device_type="npu",
        priority=100,
        description="Huawei Ascend NPUs through torch_npu fused ops",
        install_hint=INSTALL_HINT,
        proof="mapped",
    )
    from flashllm.backends.npu import kernels

    kernels.register(backend)
    return backend
