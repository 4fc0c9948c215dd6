"""The cpu backend: torch-native fast paths for x86/Arm CPUs; bf16 gated on native support."""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from flashllm.registry.backend import Availability, Backend, DeviceAdapter
from flashllm.registry.precision import DeviceProfile

logger = logging.getLogger(__name__)

_ALL_FLOAT = frozenset({torch.float32, torch.float16, torch.bfloat16})
# No fp8: x86/Arm CPUs have no fp8 arithmetic, so "fp8" here would be an emulation that widens
# every e4m3 weight to fp32 at each call: the int8 paths' memory traffic without their int8 math,
# numerics no faster than a8w8's. Refusing it names the GPUs that run fp8 (precision.py); an fp8
# checkpoint still loads with --quant_type none (dequantized) or runs as a8w8 from a float one.
# "gguf": GGUF files' quantized layouts (flashllm.quant.gguf_blocks), native kernels in quant.py
_CPU_QUANT = frozenset({"none", "w8a16", "w4a16", "a8w8", "gguf"})
# KV cache storage beyond the activation dtypes; fp8 is storage only (dequantized to fp32 to attend)
_CPU_KV = frozenset({torch.int8, torch.float8_e4m3fn})

# torch runs fp16/bf16 on every CPU; without native support it is an emulation that is far
# slower than fp32 matmuls, which is why `--dtype auto` picks float32 there.
CPU_PROFILES: tuple[DeviceProfile, ...] = (
    DeviceProfile("x86 CPU (AVX512-BF16 / AMX)", _ALL_FLOAT, _CPU_QUANT, _CPU_KV, native_bf16=True, accelerator=False),
    DeviceProfile(
        "x86 CPU (AVX2 / AVX-512)", _ALL_FLOAT, _CPU_QUANT, _CPU_KV, native_bf16=False,
        notes="bf16/fp16 are emulated and slow: use float32", accelerator=False,
    ),
    DeviceProfile(
        "Arm CPU", _ALL_FLOAT, _CPU_QUANT, _CPU_KV, native_bf16=False,
        notes="bf16 native only with the BF16 extension (not detected yet)", accelerator=False,
    ),
)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where that file does not exist)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return frozenset()
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bf16(flags: frozenset[str]) -> bool:
    """AVX512-BF16 or AMX-BF16 (x86) makes bf16 matmuls fast."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def profile_for_flags(flags: frozenset[str], machine: str) -> DeviceProfile:
    """The precision profile of a CPU with the given feature flags and `uname -m` machine."""
    if machine in ("aarch64", "arm64"):
        return CPU_PROFILES[2]
    return CPU_PROFILES[0] if has_native_bf16(flags) else CPU_PROFILES[1]


class CpuAdapter(DeviceAdapter):
    """Host memory and no-op synchronization; gloo for tensor parallelism."""

    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__("cpu")

    def set_device(self, device: torch.device) -> None:
        return None

    def synchronize(self, device: torch.device) -> None:
        return None

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(available, total) host bytes: available is the kernel's MemAvailable (free pages plus the page
        cache it can drop) where /proc/meminfo says it, else the free pages. Free pages alone sized the KV
        cache from next to nothing right after a large load, whose file pages fill the page cache (a 7.6 GB
        DeepSeek shape left too little for 4096 tokens of latent cache)."""
        page = os.sysconf("SC_PAGE_SIZE")
        available = meminfo_available()
        free = os.sysconf("SC_AVPHYS_PAGES") * page if available is None else available
        return free, os.sysconf("SC_PHYS_PAGES") * page


def meminfo_available(text: str | None = None) -> int | None:
    """MemAvailable in bytes from /proc/meminfo's text (read here when None), or None where absent or unreadable."""
    if text is None:
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                text = f.read(1 << 16)
        except OSError:
            return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
                return int(fields[0]) * 1024
            return None
    return None


class CpuBackend(Backend):
    """Torch-native CPU kernels (IPEX paths register here when it imports)."""

    def is_available(self) -> Availability:
        return True, f"{os.cpu_count()} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return profile_for_flags(cpu_flags(), os.uname().machine)

    def known_profiles(self) -> list[DeviceProfile]:
        return list(CPU_PROFILES)

    def adapter(self) -> DeviceAdapter:
        return CpuAdapter()


def make_backend() -> Backend:
    """Build the cpu backend and register its torch-native kernels."""
    backend = CpuBackend(
        name="cpu",
        device_type="cpu",
        priority=10,
        description="torch-native CPU kernels",
        model_runner="flashllm.backends.cpu.runner:CpuRunner",
    )
    from flashllm.backends.cpu import kernels, mla, moe, quant

    kernels.register(backend)
    mla.register(backend)
    moe.register(backend)
    quant.register(backend)
    return backend
