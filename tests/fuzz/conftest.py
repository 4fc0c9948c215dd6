"""Fuzzing against a live server: `nox -s fuzz` (FLASHLLM_FUZZ=1); not part of the default test run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashllm.testing.server import ServerProcess, running_server
from flashllm.testing.tiny_models import build_tiny_model

if not os.environ.get("FLASHLLM_FUZZ"):
    # minutes of generated traffic: collected only when asked for
    collect_ignore_glob = ["test_*.py"]

# A short context and a small budget: schema-valid requests finish in milliseconds on the tiny model.
SERVER_FLAGS = ["--max-model-len", "96", "--block-size", "16", "--num-kv-blocks", "64", "--max-num-seqs", "8",
                "--max-queue", "64", "--request-timeout", "30", "--max-body-bytes", str(1 << 20)]


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("fuzz-model"), "qwen2", seed=5)
    with running_server([str(model_dir), *SERVER_FLAGS]) as server:
        yield server


ADMIN_KEY = "fuzz-admin-key"


@pytest.fixture(scope="session")
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="session")
def lora_fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with the LoRA admin routes open to ADMIN_KEY, reading adapters only under an empty directory."""
    root = tmp_path_factory.mktemp("fuzz-lora")
    model_dir: Path = build_tiny_model(root / "model", "qwen2", seed=5)
    (root / "adapters").mkdir()
    flags = ["--enable-lora", "--api-key", ADMIN_KEY, "--allowed-lora-dir", str(root / "adapters")]
    with running_server([str(model_dir), *SERVER_FLAGS, *flags]) as server:
        yield server
