"""The cuda backend: NVIDIA (and ROCm-as-cuda) GPUs; device rules by compute capability.

Importing this module imports neither Triton nor initializes CUDA: both happen in
`is_available()` and in the kernels (`kernels.py` registers wrappers that import the `triton_*`
launcher modules on first call). `python -m flashllm.backends.cuda.bench --kernel NAME` checks and
times one kernel on a GPU.
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager
from typing import Any

import torch

from flashllm.registry.backend import Availability, Backend, DeviceAdapter, StepGraph
from flashllm.registry.precision import DeviceProfile

_HALF = frozenset({torch.float32, torch.float16})
_BF16 = _HALF | {torch.bfloat16}
_WEIGHT_ONLY = frozenset({"none", "w8a16", "w4a16"})
_INT8_KV = frozenset({torch.int8})
_FP8_KV = frozenset({torch.int8, torch.float8_e4m3fn})

# (minimum compute capability, profile). Volta and Turing lack bf16; fp8 needs Ada (sm89).
# int8 tensor-core GEMMs (a8w8) exist from Turing (sm75).
NVIDIA_PROFILES: tuple[tuple[tuple[int, int], DeviceProfile], ...] = (
    ((9, 0), DeviceProfile("Hopper (sm90)", _BF16, _WEIGHT_ONLY | {"a8w8", "fp8"}, _FP8_KV)),
    ((8, 9), DeviceProfile("Ada (sm89)", _BF16, _WEIGHT_ONLY | {"a8w8", "fp8"}, _FP8_KV)),
    ((8, 0), DeviceProfile("Ampere (sm80/86)", _BF16, _WEIGHT_ONLY | {"a8w8"}, _INT8_KV)),
    ((7, 5), DeviceProfile("Turing (sm75)", _HALF, _WEIGHT_ONLY | {"a8w8"}, _INT8_KV)),
    ((7, 0), DeviceProfile("Volta (sm70)", _HALF, _WEIGHT_ONLY, _INT8_KV)),
)
ROCM_PROFILE = DeviceProfile(
    "ROCm / Hygon DCU (gfx9)", _BF16, _WEIGHT_ONLY | {"a8w8"}, _INT8_KV, notes="HIP build of torch"
)


def profile_for_capability(major: int, minor: int) -> DeviceProfile:
    """The precision profile of an NVIDIA GPU with compute capability major.minor."""
    for (cap_major, cap_minor), profile in NVIDIA_PROFILES:
        if (major, minor) >= (cap_major, cap_minor):
            return profile
    raise ValueError(f"compute capability {major}.{minor} is below the supported minimum 7.0 (Volta)")


class CudaStepGraph(StepGraph):
    """A torch.cuda.CUDAGraph (also HIP graphs on ROCm torch) behind the StepGraph interface."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, pool: Any = None) -> AbstractContextManager[Any]:
        return torch.cuda.graph(self.graph, pool=pool)

    def pool(self) -> Any:
        return self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class CudaAdapter(DeviceAdapter):
    """CUDA device services; NCCL for tensor parallelism; CUDA graphs for capture."""

    dist_backend = "nccl"
    cluster_resource = "GPU"

    def __init__(self) -> None:
        super().__init__("cuda")

    def new_graph(self, device: torch.device) -> StepGraph | None:
        return CudaStepGraph()


class CudaBackend(Backend):
    """Triton kernels on CUDA devices, every op including weight-only quant_matmul and fused_moe."""

    def is_available(self) -> Availability:
        if torch.version.cuda is None and torch.version.hip is None:
            return False, f"this torch build ({torch.__version__}) has no CUDA or ROCm support"
        if not torch.cuda.is_available():
            return False, "torch has CUDA support but sees no GPU (driver missing or CUDA_VISIBLE_DEVICES empty)"
        if importlib.util.find_spec("triton") is None:
            # the kernels are registered regardless (the capability matrix must not depend on
            # whether triton happens to be installed), so without it the backend cannot run
            return False, f"{torch.cuda.device_count()} GPU(s) but triton is not installed: pip install triton"
        return True, f"{torch.cuda.device_count()} GPU(s), triton installed"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        if torch.version.hip is not None:
            return ROCM_PROFILE
        major, minor = torch.cuda.get_device_capability(device)
        return profile_for_capability(major, minor)

    def known_profiles(self) -> list[DeviceProfile]:
        return [profile for _, profile in NVIDIA_PROFILES] + [ROCM_PROFILE]

    def adapter(self) -> DeviceAdapter:
        return CudaAdapter()


def make_backend() -> Backend:
    """Build the cuda backend and register its Triton kernels (cheap: no CUDA init, no Triton import)."""
    backend = CudaBackend(
        name="cuda",
        device_type="cuda",
        priority=100,
        description="NVIDIA/ROCm GPUs through Triton kernels",
        install_hint="pip install 'flashllm[cuda]' with a CUDA build of torch and an NVIDIA driver",
    )
    from flashllm.backends.cuda import kernels

    kernels.register(backend)
    return backend
