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


def test_serve_starts_torch_with_passive_openmp_threads_unless_told_otherwise() -> None:
    # the variable must be in the environment before torch (libgomp) loads; other commands keep the default
    code = ("import os, sys\n"
            "import flashllm.cli as cli\n"
            "cli.build_parser = lambda: (_ for _ in ()).throw(SystemExit(0))  # stop before parsing\n"
            "try:\n"
            "    cli.main(sys.argv[1:])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}

    def policy(*argv: str, **extra: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                              env={**env, **extra})
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert policy("--log-level", "INFO", "serve", "model") == "PASSIVE"
    assert policy("serve", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert policy("bench", "serve") == "None"
    assert policy("generate", "--prompt", "serve") == "None"
