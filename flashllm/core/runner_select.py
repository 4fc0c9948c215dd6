"""The engine's configuration error and the ModelRunner class a selected backend runs (shared by the builder and drafters)."""

from __future__ import annotations

import importlib

from flashllm.core.model_runner import ModelRunner
from flashllm.registry.resolve import DeviceSelection


class EngineConfigError(ValueError):
    """The engine cannot start with this configuration; the message says which numbers clash."""


def model_runner_class(selection: DeviceSelection) -> type[ModelRunner]:
    """The selected backend's own ModelRunner subclass (Backend.model_runner), else the generic one."""
    target = selection.backend.model_runner
    if target is None:
        return ModelRunner
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelRunner)):
        raise EngineConfigError(f"backend {selection.backend.name!r} names model runner {target!r}, which is not "
                                "a subclass of flashllm.core.model_runner.ModelRunner")
    return cls
