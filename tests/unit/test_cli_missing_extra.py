"""A command whose optional extra is missing says, in one line, which `pip install` fixes it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from flashllm import cli

ROOT = Path(__file__).resolve().parents[2]
# import name -> distribution name, where they differ beyond '_' / '-'
DISTRIBUTION = {"yaml": "pyyaml", "llama_cpp": "llama-cpp-python"}
TRANSITIVE = {"h11": "uvicorn"}  # installed by another package of the same extra


def test_each_module_belongs_to_the_extra_it_names() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in cli.EXTRA_OF_MODULE.items():
        dist = TRANSITIVE.get(module) or DISTRIBUTION.get(module, module.replace("_", "-"))
        names = [re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in extras[extra]]
        assert dist in names, f"{module} ({dist}) is not in the {extra!r} extra: {extras[extra]}"


def test_serve_without_the_serve_extra_prints_one_line(tmp_path: Path) -> None:
    # a fresh interpreter where fastapi cannot be imported, as after `pip install -e .` alone
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from flashllm.cli import main\n"
            "sys.exit(main(['serve', '--port', '0']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == cli.USAGE_ERROR, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "flashllm serve: needs the fastapi package" in lines[0]
    assert "pip install 'flashllm[serve]'" in lines[0] and "pip install -e '.[serve]'" in lines[0]


def test_a_missing_module_of_no_extra_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.cli import devices

    def broken(args: object) -> int:
        raise ModuleNotFoundError("No module named 'not_an_extra'", name="not_an_extra")

    monkeypatch.setattr(devices, "run", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["devices"])
