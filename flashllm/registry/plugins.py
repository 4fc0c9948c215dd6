"""Plugin manager: built-in and entry-point plugins, allow/block lists, load-error reporting."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from flashllm.registry import hookspecs
from flashllm.registry.backend import Backend

logger = logging.getLogger(__name__)

ALLOW_ENV = "FLASHLLM_PLUGINS"
BLOCK_ENV = "FLASHLLM_DISABLE_PLUGINS"
BUILTIN_PLUGINS: tuple[str, ...] = ("flashllm.backends.builtin", "flashllm.models.builtin")


class PluginError(RuntimeError):
    """A plugin could not be loaded or contributed something invalid."""


@dataclass(frozen=True, slots=True)
class PluginLoadFailure:
    """An entry-point plugin that failed to import, with the distribution that provides it."""

    name: str
    distribution: str
    version: str
    error: str

    def describe(self) -> str:
        return f"plugin {self.name!r} from {self.distribution} {self.version} failed to import: {self.error}"


class FlashPlugins:
    """The host's view of its plugins; the rest of flashllm never touches pluggy directly."""

    def __init__(self, pm: pluggy.PluginManager, failures: list[PluginLoadFailure]) -> None:
        self._pm = pm
        self.failures = failures
        self._backends: dict[str, Backend] | None = None

    def plugin_names(self) -> list[str]:
        """Names of the registered plugins (built-ins and entry points)."""
        return sorted(name for name, _ in self._pm.list_name_plugin())

    def backends(self) -> dict[str, Backend]:
        """Every registered backend by name, highest priority first. Duplicate names raise."""
        if self._backends is None:
            found: dict[str, Backend] = {}

            def register(backend: Backend) -> None:
                if not isinstance(backend, Backend):
                    raise PluginError(f"register() expects a flashllm Backend, got {type(backend).__name__}")
                if backend.name in found:
                    raise PluginError(
                        f"two backends are named {backend.name!r}; disable one with {BLOCK_ENV}=<plugin name>"
                    )
                found[backend.name] = backend

            self._pm.hook.flashllm_register_backends(register=register)
            ordered = sorted(found.values(), key=lambda b: (-b.priority, b.name))
            self._backends = {b.name: b for b in ordered}
        return dict(self._backends)

    def model_targets(self) -> dict[str, Any]:
        """Architecture name -> model class or lazy "module:Class" target, from every plugin."""
        found: dict[str, Any] = {}

        def register(architecture: str, target: Any) -> None:
            if architecture in found:
                raise PluginError(f"architecture {architecture!r} is registered twice")
            found[architecture] = target

        self._pm.hook.flashllm_register_models(register=register)
        return found

    def adjust_config(self, config: Any, backend: Backend) -> None:
        """Let every plugin adjust the engine config for the chosen backend."""
        self._pm.hook.flashllm_adjust_config(config=config, backend=backend)


def make_plugin_manager(
    *, load_entry_points: bool = True, extra_plugins: Iterable[ModuleType | object] = ()
) -> FlashPlugins:
    """Build the plugin manager: built-ins, then entry points of group "flashllm", then extras.

    Entry points honour FLASHLLM_PLUGINS (comma-separated allow-list of entry-point names; set
    but empty = none) and FLASHLLM_DISABLE_PLUGINS (block-list). A plugin that fails to import
    is reported by name and distribution version; if it was explicitly allow-listed, that is an
    error. Misspelt `flashllm_*` hook implementations are caught by `check_pending()`.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    failures: list[PluginLoadFailure] = []
    if load_entry_points:
        failures = _load_entry_points(pm)
    for plugin in extra_plugins:
        pm.register(plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise PluginError(f"{err} (hook names must match flashllm.registry.hookspecs)") from err
    return FlashPlugins(pm, failures)


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def _load_entry_points(pm: pluggy.PluginManager) -> list[PluginLoadFailure]:
    allow, block = _env_list(ALLOW_ENV), _env_list(BLOCK_ENV) or set()
    failures: list[PluginLoadFailure] = []
    for ep in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        if ep.name in block or (allow is not None and ep.name not in allow):
            logger.info("plugin %r skipped by %s/%s", ep.name, ALLOW_ENV, BLOCK_ENV)
            continue
        if pm.get_plugin(ep.name) is not None:
            continue  # the same distribution visible twice on sys.path
        try:
            plugin = ep.load()
        except Exception as err:  # any import-time failure is reported, never swallowed
            failure = _failure(ep, err)
            if allow is not None and ep.name in allow:
                raise PluginError(failure.describe() + f" (it is listed in {ALLOW_ENV})") from err
            logger.warning("%s; continuing without it", failure.describe())
            failures.append(failure)
            continue
        pm.register(plugin, name=ep.name)
    return failures


def _failure(ep: metadata.EntryPoint, err: Exception) -> PluginLoadFailure:
    dist = ep.dist
    name = dist.metadata["Name"] if dist is not None else "unknown distribution"
    version = dist.version if dist is not None else "?"
    return PluginLoadFailure(ep.name, name, version, f"{type(err).__name__}: {err}")
