"""The dcu backend: Hygon DCUs (and other ROCm GPUs) running the cuda backend's Triton kernels.

A ROCm build of torch presents the GPU as device type "cuda" with `torch.version.hip` set, so this
backend shares the cuda device type and outranks the cuda backend there (priority 110 > 100); on
NVIDIA builds it is unavailable and cuda is chosen. The kernels are the cuda backend's wrappers
(Triton compiles them for AMDGPU); only the device rules differ, keyed by the gfx architecture.
"""

from __future__ import annotations

import importlib.util

import torch

from flashllm.registry.backend import Availability, Backend, DeviceAdapter, StepGraph
from flashllm.registry.precision import DeviceProfile

INSTALL_HINT = "a ROCm build of torch (Hygon DCUs: the DTK build from the vendor) and triton"

_HALF = frozenset({torch.float32, torch.float16})
_BF16 = _HALF | {torch.bfloat16}
_WEIGHT_ONLY = frozenset({"none", "w8a16", "w4a16"})

# By gfx architecture (torch.cuda.get_device_properties().gcnArchName). LLVM's AMDGPU backend
# defines the bf16 and int8 matrix (MFMA) instructions from gfx908 on; gfx906 (the class of the
# first Hygon DCUs) has only fp16/int8 dot products, so bf16 is not claimed there. fp8 MFMA starts
# with gfx94x (ROCm "Data types and precision support"); no Hygon architecture documents it, so no
# DCU profile claims fp8. Hygon's own arch-to-product mapping could not be cited from public docs.
NO_MFMA_PROFILE = DeviceProfile(
    "DCU gfx906 (no MFMA)", _HALF, _WEIGHT_ONLY, frozenset({torch.int8}), native_bf16=False,
    notes="no bf16 matrix instructions",
)
MFMA_PROFILE = DeviceProfile("DCU gfx908+ / gfx92x (MFMA)", _BF16, _WEIGHT_ONLY | {"a8w8"}, frozenset({torch.int8}))
NO_MFMA_ARCHS = frozenset({"gfx900", "gfx906"})


def profile_for_arch(gcn_arch_name: str) -> DeviceProfile:
    """The profile of a ROCm device from its gcnArchName, e.g. "gfx928:sramecc+:xnack-"."""
    arch = gcn_arch_name.split(":", 1)[0]
    if arch in NO_MFMA_ARCHS:
        return NO_MFMA_PROFILE
    if arch.startswith("gfx9"):
        return MFMA_PROFILE
    raise ValueError(
        f"ROCm architecture {arch!r} has no DCU profile (known: gfx906 and the MFMA gfx9 family); "
        "run with --backend reference or add a profile to flashllm/backends/dcu"
    )


class DcuAdapter(DeviceAdapter):
    """HIP device services through torch.cuda; RCCL (served as "nccl" by ROCm torch); HIP graphs."""

    dist_backend = "nccl"
    cluster_resource = "GPU"  # Ray counts AMD GPUs as GPUs

    def __init__(self) -> None:
        super().__init__("cuda")

    def new_graph(self, device: torch.device) -> StepGraph | None:
        from flashllm.backends.cuda import CudaStepGraph

        return CudaStepGraph()


class DcuBackend(Backend):
    """The cuda backend's Triton kernels with HIP-specific device rules."""

    def is_available(self) -> Availability:
        if torch.version.hip is None:
            return False, f"torch is not a ROCm build (torch {torch.__version__}, torch.version.hip is None)"
        if not torch.cuda.is_available():
            return False, "ROCm torch sees no DCU/GPU (driver missing or HIP_VISIBLE_DEVICES empty)"
        if importlib.util.find_spec("triton") is None:
            return False, f"{torch.cuda.device_count()} DCU(s) but triton is not installed: pip install triton"
        return True, f"{torch.cuda.device_count()} DCU(s), HIP {torch.version.hip}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return profile_for_arch(torch.cuda.get_device_properties(device).gcnArchName)

    def known_profiles(self) -> list[DeviceProfile]:
        return [NO_MFMA_PROFILE, MFMA_PROFILE]

    def adapter(self) -> DeviceAdapter:
        return DcuAdapter()


def make_backend() -> Backend:
    """Build the dcu backend on the cuda backend's kernel wrappers (no triton import, no device init)."""
    backend = DcuBackend(
        name="dcu",
        device_type="cuda",
        priority=110,
        description="Hygon DCU / ROCm GPUs through the Triton kernels",
        install_hint=INSTALL_HINT,
        proof="mapped",
    )
    from flashllm.backends.cuda import kernels

    for op, fn in kernels.WRAPPERS.items():
        backend.kernel(op, kernels.CAPS[op])(fn)
    return backend
