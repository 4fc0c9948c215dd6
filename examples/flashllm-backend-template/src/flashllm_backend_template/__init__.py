"""flashllm-backend-template: the entry-point module flashllm loads; it registers the "template" backend."""

from __future__ import annotations

from collections.abc import Callable

from flashllm import hookimpl
from flashllm.registry.backend import Backend

__version__ = "0.1.0"


@hookimpl
def flashllm_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the template backend (building it imports no vendor SDK and touches no device)."""
    from flashllm_backend_template.backend import make_backend

    register(make_backend())
