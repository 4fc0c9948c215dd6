"""Registers the built-in backends through the same hook third-party plugins use."""

from __future__ import annotations

from collections.abc import Callable

from flashllm.registry.backend import Backend
from flashllm.registry.hookspecs import hookimpl

# How each built-in backend's claims are proven (see registry.backend.PROOF_LEVELS). The vendor
# adapters (npu, xpu, dcu, gcu) declare "mapped" themselves; these are the backends whose packages
# predate the proof field. cuda stays "interpreter" until a GPU run proves it ("gpu").
BUILTIN_PROOF: dict[str, str] = {
    "reference": "conformance",
    "cpu": "conformance",
    "cuda": "interpreter",
    "ggml": "conformance",
}


@hookimpl
def flashllm_register_backends(register: Callable[[Backend], None]) -> None:
    """Register reference, cpu, ipex, cuda, xla, the vendor adapters and ggml (llama.cpp's arithmetic, chosen
    only by name). Constructing them imports no vendor SDK."""
    from flashllm.backends import cpu, cuda, dcu, gcu, ggml, ipex, npu, reference, xla, xpu

    for make_backend in (
        reference.make_backend, cpu.make_backend, ipex.make_backend, cuda.make_backend, xla.make_backend,
        npu.make_backend, xpu.make_backend, dcu.make_backend, gcu.make_backend, ggml.make_backend,
    ):
        register(_with_proof(make_backend()))


def _with_proof(backend: Backend) -> Backend:
    if backend.name in BUILTIN_PROOF:
        backend.proof = BUILTIN_PROOF[backend.name]
    return backend
