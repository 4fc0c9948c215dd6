"""Registers the built-in backends through the same hook third-party plugins use."""

from __future__ import annotations

from collections.abc import Callable

from flashllm.registry.backend import Backend
from flashllm.registry.hookspecs import hookimpl


@hookimpl
def flashllm_register_backends(register: Callable[[Backend], None]) -> None:
    """Register reference, cpu and cuda. Constructing them imports no vendor SDK."""
    from flashllm.backends import cpu, cuda, reference

    register(reference.make_backend())
    register(cpu.make_backend())
    register(cuda.make_backend())
