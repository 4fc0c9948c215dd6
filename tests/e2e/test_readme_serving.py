"""The curl examples of the README's Serving section run as written against a real server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from flashllm.testing.server import running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def _curl_commands() -> list[str]:
    section = README.read_text().split("## Serving", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]


def test_readme_has_curl_examples() -> None:
    commands = _curl_commands()
    assert len(commands) >= 5
    assert any('"stream": true' in c for c in commands)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_examples_work(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "qwen2", seed=1)
    with running_server([str(model), "--max-model-len", "256", "--num-kv-blocks", "64", "--block-size", "16"]
                        ) as server:
        for command in _curl_commands():
            command = command.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
            done = subprocess.run(["bash", "-c", f"set -o pipefail; {command} --fail-with-body"
                                   if "|" not in command else f"set -o pipefail; {command}"],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            out = done.stdout.strip()
            if '"stream": true' in command:
                events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])
            elif "/metrics" in command:
                assert "flashllm:kv_blocks_total" in out and "flashllm:kv_blocks_free" in out
            else:
                assert json.loads(out).get("error") is None, out  # a Responses object carries "error": null
