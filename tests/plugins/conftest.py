"""The example plugin package, installed for one test as pip would (entry points in group "flashllm")."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent / "flashllm-example-backend"


@pytest.fixture
def example_plugin(install_dist) -> None:
    """Install tests/plugins/flashllm-example-backend (its backend and its toy model) for this test."""
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    install_dist(project["name"], {"flashllm_example_backend": PACKAGE / "flashllm_example_backend"},
                 project["entry-points"]["flashllm"], project["version"])
