"""Device selection and op-table resolution, done once per engine with recorded fallbacks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from flashllm.ops import op_specs
from flashllm.registry.backend import ANY_DEVICE, Backend, DeviceAdapter, Kernel, OpRequest
from flashllm.registry.plugins import FlashPlugins
from flashllm.registry.precision import DeviceProfile, dtype_name, quant_requirement

logger = logging.getLogger(__name__)

REFERENCE = "reference"


class DeviceSelectionError(ValueError):
    """No backend can serve the requested device."""


class PrecisionError(ValueError):
    """The device cannot run the requested dtype or quantization scheme."""


class KernelResolutionError(RuntimeError):
    """An op has no kernel for the request (or, in strict mode, only the reference has one)."""


@dataclass(frozen=True, slots=True)
class DeviceSelection:
    """The device the engine runs on and the backend whose kernels it prefers."""

    device: torch.device
    backend: Backend
    profile: DeviceProfile
    adapter: DeviceAdapter


@dataclass(frozen=True, slots=True)
class Fallback:
    """One op that runs the reference kernel instead of the selected backend's, and why."""

    op: str
    backend: str
    reason: str


class OpTable:
    """A frozen op-name -> kernel mapping; layers bind `table.rms_norm` etc. at construction."""

    __slots__ = ("_kernels", "sources", "fallbacks")

    def __init__(self, kernels: Mapping[str, Kernel], fallbacks: list[Fallback]) -> None:
        object.__setattr__(self, "_kernels", MappingProxyType(dict(kernels)))
        object.__setattr__(self, "sources", MappingProxyType({op: k.backend for op, k in kernels.items()}))
        object.__setattr__(self, "fallbacks", tuple(fallbacks))

    def __getattr__(self, op: str) -> Callable[..., Any]:
        try:
            return self._kernels[op].fn
        except KeyError:
            raise AttributeError(f"op table has no op {op!r}; ops: {', '.join(self._kernels)}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("OpTable is frozen; resolve a new one instead")

    def kernel(self, op: str) -> Kernel:
        """The resolved Kernel record (function, caps, backend) of `op`."""
        return self._kernels[op]

    def format_fallbacks(self) -> str:
        """The fallback table as aligned text (empty string when there are none)."""
        if not self.fallbacks:
            return ""
        width = max(len(f.op) for f in self.fallbacks)
        rows = [f"  {f.op:<{width}}  {f.backend} -> reference: {f.reason}" for f in self.fallbacks]
        return "ops running the reference kernel:\n" + "\n".join(rows)


def select_device(spec: str = "auto", backend: str | None = None, *, plugins: FlashPlugins) -> DeviceSelection:
    """Pick the device and backend: `spec` is "auto", a device type ("cuda") or "cuda:1".

    "auto" prefers accelerators, then the CPU. With `backend`, that backend is used (the
    reference backend runs on any device). When nothing matches, the error lists every backend
    with the reason it is unavailable and what would provide it.
    """
    if spec == "gpu" or spec.startswith("gpu:"):  # PaddleNLP's spelling of an NVIDIA device
        spec = "cuda" + spec[3:]
    backends = plugins.backends()
    if backend is not None:
        if backend not in backends:
            raise DeviceSelectionError(f"unknown backend {backend!r}; registered: {', '.join(backends)}")
        return _select_named(backends[backend], spec, backends)
    candidates = [b for b in backends.values() if b.device_type != ANY_DEVICE]
    if spec != "auto":
        # by string: torch.device("npu") only parses once torch_npu has registered the device type
        wanted = spec.split(":", 1)[0]
        candidates = [b for b in candidates if b.device_type == wanted]
    else:
        candidates.sort(key=lambda b: (b.device_type == "cpu", -b.priority))
    for candidate in candidates:
        ok, _ = candidate.is_available()
        if ok:
            device = _device_for(candidate, spec)
            return _selection(candidate, device, candidate)
    summary = f"no available backend for device {spec!r}"
    if candidates:  # the device type is known: the first line says why none of its backends runs here
        summary = f"device {spec!r} is unavailable: " + "; ".join(f"{c.name}: {c.is_available()[1]}" for c in candidates)
    raise DeviceSelectionError(f"{summary}.\n{describe_backends(backends)}")


def describe_backends(backends: Mapping[str, Backend]) -> str:
    """One line per backend: name, device type, availability with reason, install hint."""
    lines = []
    for b in backends.values():
        ok, reason = b.is_available()
        hint = "" if ok or not b.install_hint else f"; install: {b.install_hint}"
        lines.append(f"  {b.name} ({b.device_type}): {'available' if ok else 'unavailable'}: {reason}{hint}")
    return "backends:\n" + "\n".join(lines)


def _select_named(chosen: Backend, spec: str, backends: Mapping[str, Backend]) -> DeviceSelection:
    ok, reason = chosen.is_available()
    if not ok:
        raise DeviceSelectionError(f"backend {chosen.name!r} is unavailable: {reason}. {chosen.install_hint}")
    if chosen.device_type != ANY_DEVICE:
        return _selection(chosen, _device_for(chosen, spec), chosen)
    # The reference runs anywhere; the device itself is described by the backend that owns it.
    owners = [b for b in backends.values() if b.device_type != ANY_DEVICE and b.is_available()[0]]
    if spec != "auto":
        owners = [b for b in owners if b.device_type == spec.split(":", 1)[0]]
    else:
        owners.sort(key=lambda b: (b.device_type == "cpu", -b.priority))
    if not owners:
        raise DeviceSelectionError(f"no available device for {spec!r}.\n{describe_backends(backends)}")
    return _selection(chosen, _device_for(owners[0], spec), owners[0])


def _device_for(backend: Backend, spec: str) -> torch.device:
    device = torch.device(backend.device_type if spec == "auto" else spec)
    count = backend.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceSelectionError(f"{spec} requested but backend {backend.name!r} sees {count} device(s)")
    return device


def _selection(backend: Backend, device: torch.device, owner: Backend) -> DeviceSelection:
    return DeviceSelection(device, backend, owner.device_profile(device), owner.adapter())


def check_precision(
    selection: DeviceSelection, dtype: torch.dtype, quant: str = "none", kv_dtype: torch.dtype | None = None
) -> None:
    """Raise PrecisionError, naming what is supported, if the device cannot run the request."""
    profile, where = selection.profile, f"{selection.device} ({selection.profile.name})"
    if dtype not in profile.dtypes:
        supported = ", ".join(sorted(dtype_name(d) for d in profile.dtypes))
        raise PrecisionError(f"{dtype_name(dtype)} is not supported on {where}; supported dtypes: {supported}")
    if quant not in profile.quant:
        hint = quant_requirement(quant)
        raise PrecisionError(f"quantization {quant!r} is not supported on {where}; supported: {sorted(profile.quant)}"
                             + (f" ({hint})" if hint else ""))
    if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in profile.kv_dtypes:
        supported = ", ".join(sorted(dtype_name(d) for d in profile.kv_dtypes)) or "none beyond the model dtype"
        raise PrecisionError(f"KV cache dtype {dtype_name(kv_dtype)} is not supported on {where}; supported: {supported}")


def resolve_ops(
    selection: DeviceSelection,
    request: OpRequest,
    *,
    plugins: FlashPlugins,
    strict: bool = False,
) -> OpTable:
    """Bind every op to the best kernel for `request` on the selected backend.

    Per op: the selected backend's first kernel whose caps match; otherwise the reference kernel,
    with the reason recorded, logged once as a table at WARNING (or raised when `strict`).
    """
    check_precision(selection, request.dtype, request.quant, request.kv_dtype)
    backends = plugins.backends()
    reference = backends[REFERENCE]
    chosen: dict[str, Kernel] = {}
    fallbacks: list[Fallback] = []
    for name, spec in op_specs().items():
        kernel, reason = _match(selection.backend, name, request, spec.uses)
        if kernel is None and selection.backend is not reference:
            fallbacks.append(Fallback(name, selection.backend.name, reason))
            kernel, ref_reason = _match(reference, name, request, spec.uses)
            reason = f"{reason}; reference: {ref_reason}"
        if kernel is None:
            raise KernelResolutionError(f"no kernel can run op {name!r} for {request}: {reason}")
        chosen[name] = kernel
    table = OpTable(chosen, fallbacks)
    if fallbacks:
        if strict:
            raise KernelResolutionError(table.format_fallbacks() + "\n(--strict-kernels forbids fallbacks)")
        logger.warning("%s", table.format_fallbacks())
    return table


def _match(backend: Backend, op: str, request: OpRequest, uses: frozenset[str]) -> tuple[Kernel | None, str]:
    kernels = backend.kernels.get(op, [])
    if not kernels:
        return None, "no kernel registered"
    reasons = []
    for kernel in kernels:
        why = kernel.mismatch(request, uses)
        if why is None:
            return kernel, ""
        reasons.append(why)
    return None, "; ".join(reasons)

