"""Promise 7 (nothing from a model directory executes), in the code itself: no module of flashllm/ calls
eval, exec, compile, torch.load or __import__, or imports pickle-like loaders. Read from the syntax tree, so
words in messages and comments ("pickle .bin files are refused") do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flashllm"
CALLS = {"eval", "exec", "compile", "__import__"}  # builtins that run or build code from text
MODULES = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "joblib", "shelve"}


def findings(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLS:
            found.append(f"{name}:{node.lineno}: {node.func.id}()")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            found.append(f"{name}:{node.lineno}: torch.load()")
        elif isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in MODULES:
            found.append(f"{name}:{node.lineno}: from {node.module} import ...")
    return found


def test_no_module_runs_code_from_text_or_unpickles() -> None:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 100, "the package was not found"
    found = [f for path in sources for f in findings(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))]
    assert found == []


@pytest.mark.parametrize("source", ["eval(text)", "exec(code)", "import pickle", "from pickle import loads",
                                    "import torch\ntorch.load(path)", "__import__(name)", "import dill.settings"])
def test_each_forbidden_form_is_found(source: str) -> None:
    assert findings(source, "x.py"), source


@pytest.mark.parametrize("source", ["model.eval()", "re.compile(pattern)", "msg = 'pickle files are refused'",
                                    "torch.loads = None", "json.load(f)"])
def test_lookalikes_are_not_found(source: str) -> None:
    assert findings(source, "x.py") == []
