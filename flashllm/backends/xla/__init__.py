"""The xla backend: torch_xla devices (TPU, or PJRT's CPU client) with static shape buckets.

Importing this module imports no torch_xla: `is_available()` and the adapter import it on first
use, so registering the backend costs nothing where it is not installed. XLA compiles one graph
per distinct set of input shapes, so the adapter asks the model runner for shape buckets and cuts
the lazily traced graph at the end of every step; the kernels (kernels.py) are plain torch with
no data-dependent shapes or host syncs.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from contextlib import AbstractContextManager
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from flashllm.backends.npu import import_vendor
from flashllm.registry.backend import Availability, Backend, DeviceAdapter, ShapeBuckets
from flashllm.registry.precision import DeviceProfile

DISTRIBUTION = "torch_xla"
INSTALL_HINT = "pip install 'torch==2.9.*' 'torch-xla==2.9.*' (torch_xla x.y runs on torch x.y only), then set PJRT_DEVICE=TPU, CUDA or CPU"
PJRT_HINT = "export PJRT_DEVICE=TPU (or CUDA, or CPU for the host); torch_xla picks no device without it here"

# fp32 and bf16 only: bf16 is the TPU's native half type, while fp16 is not a TPU compute type and
# XLA:CPU widens it, so fp16 is neither fast anywhere XLA runs nor checked by the xla session.
# No quantized weights or KV caches: the xla kernels implement float math only, and the quantized
# reference paths have not been run under XLA. The int8 KV column stays empty for the same reason.
_DTYPES = frozenset({torch.float32, torch.bfloat16})
PJRT_CPU = DeviceProfile(
    "XLA (PJRT CPU)", _DTYPES, frozenset({"none"}), native_bf16=False, accelerator=False,
    notes="the client `nox -s xla` runs conformance on; TPU / GPU PJRT clients run the same kernels, unproven here",
)
PJRT_TPU = DeviceProfile("XLA (PJRT TPU)", _DTYPES, frozenset({"none"}), native_bf16=True, accelerator=True)
PJRT_GPU = DeviceProfile("XLA (PJRT CUDA)", _DTYPES, frozenset({"none"}), native_bf16=True, accelerator=True)
_PROFILES = {"CPU": PJRT_CPU, "TPU": PJRT_TPU, "CUDA": PJRT_GPU}


def _major_minor(version: str) -> str:
    match = re.match(r"(\d+\.\d+)", version)
    return match.group(1) if match else version


@lru_cache(maxsize=4)
def xla_status(pjrt_device: str | None) -> Availability:
    """Whether torch_xla is installed, matches torch, imports, and has a PJRT device; and why (not).

    The versions are compared before importing: a torch_xla built for another torch fails with
    undefined symbols. Cached per PJRT_DEVICE value, as importing torch_xla takes seconds.
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False, f"torch_xla is not installed: {INSTALL_HINT}"
    if _major_minor(version) != _major_minor(torch.__version__):
        return False, (f"torch_xla {version} needs torch {_major_minor(version)}.*, but torch {torch.__version__} is "
                       "installed: install the matching pair in its own environment (nox -s xla)")
    if not pjrt_device:
        return False, f"torch_xla {version} is installed but PJRT_DEVICE is not set: {PJRT_HINT}"
    module, reason = import_vendor("torch_xla", INSTALL_HINT)
    if module is None:
        return False, reason
    runtime = importlib.import_module("torch_xla.runtime")
    try:
        count = runtime.addressable_device_count()  # starts the PJRT client
    except Exception as exc:  # reported as the reason: no TPU/GPU behind PJRT_DEVICE, or a broken runtime
        return False, (f"torch_xla {version} imported but the PJRT_DEVICE={pjrt_device} client did not start: "
                       f"{type(exc).__name__}: {exc}")
    if count < 1:
        return False, f"torch_xla {version} imported but PJRT_DEVICE={pjrt_device} shows no device"
    return True, f"torch_xla {version} on torch {torch.__version__}, {count} PJRT {runtime.device_type()} device(s)"


def _xla() -> ModuleType:
    return importlib.import_module("torch_xla")


class XlaAdapter(DeviceAdapter):
    """torch_xla device services: step-end graph cuts, shape buckets, and the "xla" process group."""

    dist_backend = "xla"  # torch_xla.distributed.xla_backend registers it; tensor parallelism on XLA is untested
    shape_buckets = ShapeBuckets()

    def __init__(self) -> None:
        super().__init__("xla")

    def set_device(self, device: torch.device) -> None:
        # a torch_xla process drives the devices PJRT gives it; there is no current-device switch
        return None

    def synchronize(self, device: torch.device) -> None:
        _xla().sync(wait=True)

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        if importlib.import_module("torch_xla.runtime").device_type() == "CPU":
            # PJRT's CPU client allocates from host memory and reports no device memory of its own
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        info = importlib.import_module("torch_xla.core.xla_model").get_memory_info(device)
        return info["bytes_limit"] - info["bytes_used"], info["bytes_limit"]

    def inference_mode(self) -> AbstractContextManager[Any]:
        # torch_xla's functionalization sets version counters, which inference tensors refuse
        return torch.no_grad()

    def end_step(self, device: torch.device) -> None:
        # without the cut, each step's KV cache writes would stay pending and grow the next
        # step's graph, which then never matches a compiled one (torch_xla.sync was xm.mark_step)
        _xla().sync()


class XlaBackend(Backend):
    """Plain-torch kernels traced by torch_xla; static shapes come from the adapter's buckets."""

    def is_available(self) -> Availability:
        return xla_status(os.environ.get("PJRT_DEVICE"))

    def device_count(self) -> int:
        return importlib.import_module("torch_xla.runtime").addressable_device_count()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        kind = importlib.import_module("torch_xla.runtime").device_type()
        if kind in _PROFILES:
            return _PROFILES[kind]
        return DeviceProfile(f"XLA (PJRT {kind})", _DTYPES, frozenset({"none"}), native_bf16=False,
                             notes="a PJRT client flashllm has no profile for: fp32/bf16 claimed, bf16 speed unknown")

    def known_profiles(self) -> list[DeviceProfile]:
        # only the client the xla session proves; the TPU / GPU profiles apply at run time
        return [PJRT_CPU]

    def adapter(self) -> DeviceAdapter:
        return XlaAdapter()


def make_backend() -> Backend:
    """Build the xla backend and register its kernels (no torch_xla import).

    Priority 80: below the vendors' own GPU/NPU backends, above the host CPU backends, so
    `--device auto` picks XLA only where PJRT_DEVICE names a device.
    """
    backend = XlaBackend(
        name="xla",
        device_type="xla",
        priority=80,
        description="torch_xla (TPU, PJRT CPU): plain-torch kernels with static shape buckets",
        install_hint=INSTALL_HINT,
        proof="conformance",  # nox -s xla runs the generated conformance suite on PJRT's CPU client
    )
    from flashllm.backends.xla import kernels, mla

    kernels.register(backend)
    mla.register(backend)
    return backend
