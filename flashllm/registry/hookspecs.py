"""The flashllm_* plugin hooks: how backends, models and config adjustments are contributed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from flashllm.registry.backend import Backend

PROJECT_NAME = "flashllm"
ENTRY_POINT_GROUP = "flashllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def flashllm_register_backends(register: Callable[[Backend], None]) -> None:
    """Contribute device backends.

    Call `register(backend)` once per `flashllm.registry.Backend` this plugin provides. Keep this
    cheap: build the Backend object and its kernel table, but import vendor SDKs only inside
    `Backend.is_available()` or lazily inside kernels. Two backends with one name is an error.
    """


@hookspec
def flashllm_register_models(register: Callable[[str, Any], None]) -> None:
    """Contribute model architectures.

    Call `register(architecture, target)` where `architecture` is the exact string found in a
    checkpoint's `config.json` `architectures[0]` (e.g. "LlamaForCausalLM") and `target` is the
    model class or a lazy "package.module:ClassName" string. The class implements the model
    contract of `flashllm.models.base.CausalLM`, including `parse_config` for its own config.json.
    """


@hookspec
def flashllm_adjust_config(config: Any, backend: Backend) -> None:
    """Adjust the engine config in place once the backend is chosen, before the model is built.

    `config` is the `flashllm.config.EngineConfig`; `backend` the selected Backend. Use it for
    device-specific defaults (e.g. a block size the backend's attention kernel requires). Every
    plugin sees the config after the previous plugin's changes; log what you change.
    """
