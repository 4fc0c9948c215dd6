"""Fixtures: the template backend as flashllm discovers it, through the installed entry point."""

from __future__ import annotations

from importlib import metadata

import pytest
from flashllm.registry.backend import Backend
from flashllm.registry.plugins import FlashPlugins, make_plugin_manager

import flashllm_backend_template
from flashllm_backend_template.backend import NAME

NOT_INSTALLED = (
    "flashllm did not discover the {name!r} backend: install this package first (pip install -e .) and "
    "check that FLASHLLM_PLUGINS / FLASHLLM_DISABLE_PLUGINS do not exclude its entry point"
)


@pytest.fixture(scope="session")
def entry_point_name() -> str:
    """The name under which pyproject.toml declares this package in the "flashllm" entry-point group."""
    names = [ep.name for ep in metadata.entry_points(group="flashllm")
             if ep.value == flashllm_backend_template.__name__]
    assert len(names) == 1, f"expected one 'flashllm' entry point for this package, found {names}"
    return names[0]


@pytest.fixture(scope="session")
def plugins(entry_point_name: str) -> FlashPlugins:
    """flashllm's plugin manager with every installed entry point loaded, as the engine builds it."""
    found = make_plugin_manager()
    assert not found.failures, "; ".join(f.describe() for f in found.failures)
    assert NAME in found.backends(), NOT_INSTALLED.format(name=NAME)
    return found


@pytest.fixture(scope="session")
def template_backend(plugins: FlashPlugins) -> Backend:
    return plugins.backends()[NAME]
