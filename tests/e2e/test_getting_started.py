"""docs/getting-started.md followed literally: its first-run, Python and prediction blocks run as written.

The install and serving blocks are left out (they install packages or start a long-running
server; tests/e2e/test_readme_serving.py runs the README's serving examples against a server).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"


def _blocks(section: str, language: str) -> list[str]:
    text = PAGE.read_text(encoding="utf-8").split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture()
def shell_env(tmp_path: Path) -> dict[str, str]:
    """PATH with a `flashllm` that runs this checkout's package under this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "flashllm"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m flashllm "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    root = str(PAGE.parents[1])
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


def _run_bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done


def test_first_run_blocks_work(tmp_path: Path, shell_env: dict[str, str]) -> None:
    (script,) = _blocks("First run", "bash")
    done = _run_bash(script, tmp_path, shell_env)
    assert "reference" in done.stdout  # flashllm devices lists the backends
    (program,) = _blocks("First run", "python")
    path = tmp_path / "first_run.py"
    path.write_text(program)
    ran = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=shell_env, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr


def test_batch_prediction_block_works(tmp_path: Path, shell_env: dict[str, str]) -> None:
    (script,) = _blocks("Batch prediction from a file", "bash")
    _run_bash(script, tmp_path, shell_env)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["src"] for line in lines] == ["Hello", "Tell me a joke."]
    assert all(isinstance(line["output"], str) and line["finish_reason"] in ("length", "stop") for line in lines)
