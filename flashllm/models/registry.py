"""ModelRegistry: exact HF `architectures[0]` strings -> model classes, loaded lazily."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from flashllm.models.errors import ModelLoadError


class UnknownArchitectureError(ModelLoadError):
    """An architecture no registered model implements; the message lists the supported ones."""


class ModelRegistry:
    """Maps exact architecture names (e.g. "LlamaForCausalLM") to a class or "module:Class" string.

    Matching is exact, never by substring. Lazy strings are imported on first `resolve`.
    """

    def __init__(self) -> None:
        self._targets: dict[str, type | str] = {}

    @classmethod
    def from_targets(cls, targets: Mapping[str, type | str]) -> ModelRegistry:
        """A registry holding `targets` (architecture -> class or "module:Class"), e.g. plugins' model_targets()."""
        registry = cls()
        for architecture, target in targets.items():
            registry.register(architecture, target)
        return registry

    def register(self, architecture: str, target: type | str) -> None:
        """Add one architecture; registering a name twice is an error (two plugins disagree)."""
        if not isinstance(architecture, str) or not architecture:
            raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
        if isinstance(target, str) and target.count(":") != 1:
            raise ValueError(f"lazy model target {target!r} must look like 'package.module:ClassName'")
        if not isinstance(target, (str, type)):
            raise TypeError(f"model target for {architecture!r} must be a class or a 'module:Class' "
                            f"string, got {type(target).__name__}")
        if architecture in self._targets:
            raise ValueError(
                f"architecture {architecture!r} is already registered (to {self._describe(architecture)}); "
                "two plugins provide it: disable one with FLASHLLM_DISABLE_PLUGINS"
            )
        self._targets[architecture] = target

    def resolve(self, architecture: str) -> type:
        """The model class for `architecture`, importing a lazy target on first use."""
        target = self._targets.get(architecture)
        if target is None:
            raise UnknownArchitectureError(
                f"architecture {architecture!r} is not supported; supported: "
                f"{', '.join(self.architectures()) or '(none registered)'}; "
                "a plugin can add more via flashllm_register_models"
            )
        if isinstance(target, str):
            module_name, class_name = target.split(":")
            target = getattr(importlib.import_module(module_name), class_name)
            if not isinstance(target, type):
                raise TypeError(f"{self._targets[architecture]!r} is not a class")
            self._targets[architecture] = target
        return target

    def architectures(self) -> list[str]:
        """Registered architecture names, sorted."""
        return sorted(self._targets)

    def __contains__(self, architecture: object) -> bool:
        return architecture in self._targets

    def _describe(self, architecture: str) -> str:
        target = self._targets[architecture]
        return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
