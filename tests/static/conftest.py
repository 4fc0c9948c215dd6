"""Fixtures for static-graph tests: tiny models with tokenizers and their ONNX exports, built once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from flashllm.testing.tiny_models import build_tiny_model

PRESETS = ("llama3", "qwen2")  # llama3: GQA + llama3 rope scaling; qwen2: qkv bias + tied embeddings
ONNX_PACKAGES = ("onnx", "onnxruntime", "onnxscript")


@pytest.fixture(scope="session")
def onnx_ready() -> None:
    """Skip the test when the `onnx` extra is missing (the default `tests` session may lack it)."""
    missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"static mode needs {', '.join(missing)} (pip install 'flashllm[onnx]'; nox -s onnx)")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {p: build_tiny_model(tmp_path_factory.mktemp(f"hf-{p}"), p, seed=5) for p in PRESETS}


@pytest.fixture(scope="session")
def exported(onnx_ready: None, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    """preset -> export directory; llama3 goes through the `flashllm export` command, qwen2 the API."""
    from flashllm.cli import main
    from flashllm.static.export import export_onnx

    out = {p: tmp_path_factory.mktemp(f"onnx-{p}") / "export" for p in PRESETS}
    assert main(["export", str(model_dirs["llama3"]), "--format", "onnx", "--output", str(out["llama3"])]) == 0
    export_onnx(model_dirs["qwen2"], out["qwen2"])
    return out
