"""The CLI parser imports every command module: none of them may need an optional extra to load."""

from __future__ import annotations

import subprocess
import sys

# Everything outside the core dependencies of pyproject.toml (extras: serve, ui, bench, cuda, test, ray).
OPTIONAL = ["fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "gradio", "openai", "matplotlib",
            "rouge_score", "triton", "pexpect", "playwright", "ray"]


def test_every_command_loads_without_optional_extras() -> None:
    code = ("import sys\n"
            f"for name in {OPTIONAL!r}:\n"
            "    sys.modules[name] = None  # any import of it now fails\n"
            "from flashllm.cli import build_parser\n"
            "parser = build_parser()\n"
            "print(sorted(parser._subparsers._group_actions[0].choices))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for command in ("serve", "chat", "webui", "eval", "bench", "generate", "predict", "devices"):
        assert f"'{command}'" in done.stdout
