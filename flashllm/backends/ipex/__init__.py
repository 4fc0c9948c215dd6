"""The ipex backend: intel-extension-for-pytorch kernels on x86 CPUs, the cpu backend's elsewhere."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from dataclasses import replace
from functools import lru_cache

import torch

from flashllm.backends.cpu import CPU_PROFILES, CpuBackend
from flashllm.ops import op_specs
from flashllm.registry.backend import Availability, Backend, Caps
from flashllm.registry.precision import DeviceProfile

DISTRIBUTION = "intel-extension-for-pytorch"
MISSING = ("intel_extension_for_pytorch is not installed: pip install intel-extension-for-pytorch==2.8.* needs "
           "torch 2.8 and transformers 4, and flashllm needs transformers>=5, so none runs today (docs/devices.md)")
INSTALL_HINT = "pip install intel-extension-for-pytorch==2.8.* beside torch 2.8 and transformers 4 (docs/devices.md)"


def _major_minor(version: str) -> str:
    match = re.match(r"(\d+\.\d+)", version)
    return match.group(1) if match else version


@lru_cache(maxsize=1)
def ipex_status() -> Availability:
    """Whether intel_extension_for_pytorch is installed, matches torch, and imports; and why (not).

    The versions are compared before importing because IPEX aborts the process on a torch
    mismatch instead of raising.
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False, MISSING
    if _major_minor(version) != _major_minor(torch.__version__):
        return False, (
            f"{DISTRIBUTION} {version} needs torch {_major_minor(version)}.*, but torch {torch.__version__} "
            f"is installed: install the matching pair in its own environment (nox -s ipex)"
        )
    try:
        importlib.import_module("intel_extension_for_pytorch")
    except Exception as exc:  # reported as the reason the backend is unavailable, not swallowed
        return False, f"intel_extension_for_pytorch {version} failed to import: {type(exc).__name__}: {exc}"
    return True, f"{DISTRIBUTION} {version} on torch {torch.__version__}"


class IpexBackend(CpuBackend):
    """IPEX fused kernels where they map onto flashllm's ops; x86 only, like IPEX itself."""

    def is_available(self) -> Availability:
        return ipex_status()

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return _without_fp8_kv(super().device_profile(device))

    def known_profiles(self) -> list[DeviceProfile]:
        return [_without_fp8_kv(p) for p in CPU_PROFILES if p.name.startswith("x86")]


def _without_fp8_kv(profile: DeviceProfile) -> DeviceProfile:
    """IPEX 2.8 pins torch 2.8, whose CPU indexing has no float8_e4m3fn: no fp8 KV cache there."""
    notes = "; ".join(filter(None, (profile.notes, "no fp8 KV cache (torch 2.8 cannot index e4m3 on CPU)")))
    return replace(profile, kv_dtypes=profile.kv_dtypes - {torch.float8_e4m3fn}, notes=notes)


def make_backend() -> Backend:
    """Build the ipex backend: its IPEX kernels first, then the cpu backend's for everything else.

    Constructing it never imports IPEX (kernels import it on first call), so the registered
    kernels and the capability matrix are the same whether or not IPEX is installed; only
    `is_available()` depends on it. Priority 20 puts it above cpu (10) when IPEX imports.
    """
    backend = IpexBackend(
        name="ipex",
        device_type="cpu",
        priority=20,
        description=(
            "intel-extension-for-pytorch CPU kernels (rms_norm, rotary, gated activations, paged attention, "
            "weight-only int8/int4 linear)"
        ),
        install_hint=INSTALL_HINT,
        proof="conformance",
    )
    from flashllm.backends import cpu
    from flashllm.backends.ipex import kernels, woq

    kernels.register(backend)
    woq.register(backend)
    # Ops (and cases) IPEX does not cover run the cpu backend's kernels, so selecting ipex never
    # drops an op to the reference; the Kernel records keep backend "cpu" to say where they come from.
    specs = op_specs()
    for op, cpu_kernels in cpu.make_backend().kernels.items():
        ours = list(backend.kernels.get(op, []))
        extra = [k for k in cpu_kernels if not any(_covers(mine.caps, k.caps, specs[op].uses) for mine in ours)]
        backend.kernels.setdefault(op, []).extend(extra)
    return backend


def _covers(ours: Caps, theirs: Caps, uses: frozenset[str]) -> bool:
    """Whether every request `theirs` serves is served by `ours`, on the request fields the op uses."""
    if not theirs.dtypes <= ours.dtypes:
        return False
    if "kv_dtype" in uses and not theirs.kv_dtypes <= ours.kv_dtypes:
        return False
    if "quant" in uses and not theirs.quant <= ours.quant:
        return False
    return all(
        getattr(ours, field) is None or (getattr(theirs, field) is not None and getattr(theirs, field) <= getattr(ours, field))
        for field, used in (("head_sizes", "head_size"), ("block_sizes", "block_size"))
        if used in uses
    )
