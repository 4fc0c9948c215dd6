"""A test backend registered through the plugin hooks, and a cpu device selection that resolves against it."""

from __future__ import annotations

from typing import Any

import torch

from flashllm.registry.backend import Backend, DeviceAdapter
from flashllm.registry.hookspecs import hookimpl
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import DeviceProfile
from flashllm.registry.resolve import DeviceSelection


class BackendPlugin:
    """A plugin registering one Backend (as a third-party package's would)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @hookimpl
    def flashllm_register_backends(self, register: Any) -> None:
        register(self.backend)


def cpu_selection(backend: Backend, dtypes: frozenset[torch.dtype]) -> tuple[DeviceSelection, Any]:
    """(a cpu DeviceSelection of `backend`, a plugin manager knowing it beside the built-ins) for resolve_ops."""
    plugins = make_plugin_manager(load_entry_points=False, extra_plugins=[BackendPlugin(backend)])
    profile = DeviceProfile("test cpu", dtypes, accelerator=False)
    return DeviceSelection(torch.device("cpu"), backend, profile, DeviceAdapter("cpu")), plugins
