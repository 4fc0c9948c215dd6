"""Start-up failures end in one line naming the file or flag and the fix, exit code 2, no traceback (promise 12)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
USAGE_ERROR = 2
WEIGHTS_LOADED = "Loading weights"  # the loader's progress line: its absence shows the check came first


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _flashllm(*args: str) -> list[str]:
    return ["-m", "flashllm", *args]


def _assert_one_line(done: subprocess.CompletedProcess[str], command: str, *names: str) -> str:
    """The error line (the last one on stderr); fails on a traceback, a wrong exit code or missing names."""
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == USAGE_ERROR, f"exit {done.returncode}: {done.stderr[-2000:]}"
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"flashllm {command}: "), done.stderr[-2000:]
    for name in names:
        assert name in line, line
    return line


def _with_file(name: str, text: str) -> Callable[[Path], None]:
    return lambda model_dir: (model_dir / name).write_text(text)


def _generation_config(**values: object) -> Callable[[Path], None]:
    def mutate(model_dir: Path) -> None:
        path = model_dir / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**config, **values}))
    return mutate


@pytest.fixture()
def broken_dir(tiny_model_dir: Path, tmp_path: Path) -> Callable[[Callable[[Path], None]], Path]:
    def make(mutate: Callable[[Path], None]) -> Path:
        model_dir = tmp_path / "model"
        shutil.copytree(tiny_model_dir, model_dir)
        mutate(model_dir)
        return model_dir
    return make


@pytest.mark.parametrize(("name", "mutate", "names"), [
    ("deep config.json", _with_file("config.json", "[" * 100_000), ("config.json", "nested too deeply")),
    ("temperature -5", _generation_config(temperature=-5), ("generation_config.json", "temperature", "-5")),
    ("top_p as text", _generation_config(top_p="high"), ("generation_config.json", "top_p")),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_model_file_fails_in_one_line_before_the_weights_load(
        broken_dir: Callable[[Callable[[Path], None]], Path], name: str, mutate: Callable[[Path], None],
        names: tuple[str, ...], command: str) -> None:
    model_dir = broken_dir(mutate)
    with socket.create_server(("127.0.0.1", 0)) as held:  # a serve that got as far as binding fails loudly
        args = (["generate", "hi", "--model", str(model_dir), "--max-tokens", "2"] if command == "generate" else
                ["serve", str(model_dir), "--port", str(held.getsockname()[1])])
        done = _run(_flashllm(*args, "--device", "cpu"))
    _assert_one_line(done, command, *names)
    assert WEIGHTS_LOADED not in done.stderr


def test_serve_ui_without_gradio_fails_before_the_model_loads(tiny_model_dir: Path) -> None:
    # gradio mapped to None in sys.modules: `import gradio` raises ImportError, as where it is not installed
    code = ("import sys; sys.modules['gradio'] = None; from flashllm.cli import main; "
            f"sys.exit(main(['serve', {str(tiny_model_dir)!r}, '--ui', '--port', '1', '--device', 'cpu']))")
    done = _run(["-c", code])
    _assert_one_line(done, "serve", "--ui", "pip install")
    assert WEIGHTS_LOADED not in done.stderr


def test_generate_chat_with_a_prompt_past_the_context_fails_in_one_line(tiny_model_dir: Path) -> None:
    done = _run(_flashllm("generate", "hello world " * 400, "--chat", "--model", str(tiny_model_dir),
                          "--max-tokens", "2", "--device", "cpu"))
    _assert_one_line(done, "generate", "max_model_len", "shorten the prompt")


@pytest.mark.parametrize(("flag", "value"), [("--max-connections", "0"), ("--header-timeout", "-1"),
                                             ("--body-timeout", "inf"), ("--keep-alive-timeout", "nan")])
def test_a_bad_connection_flag_fails_in_one_line(tiny_model_dir: Path, flag: str, value: str) -> None:
    done = _run(_flashllm("serve", str(tiny_model_dir), flag, value, "--port", "1", "--device", "cpu"))
    _assert_one_line(done, "serve", flag)
    assert WEIGHTS_LOADED not in done.stderr


@pytest.mark.parametrize("module", ["flashllm", "flashllm.cli"])
def test_both_module_entry_points_run_the_command(module: str) -> None:
    done = _run(["-m", module, "generate", "--max-tokens", "x"])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == USAGE_ERROR, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "--max-tokens" in done.stderr and "invalid int value" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(("flag", "value"), [
    ("--port", "70000"), ("--port", "-1"), ("--max-queue", "-5"), ("--max-body-bytes", "0"),
    ("--request-timeout", "nan"), ("--request-timeout", "-1"), ("--shutdown-drain-timeout", "inf"),
    ("--host", "256.1.1.1"), ("--max-num-seqs", "0"), ("--max-num-batched-tokens", "-3"),
    ("--num-scheduler-steps", "0"), ("--tool-call-parser", "pythonic"), ("--scheduling-policy", "lifo"),
])
def test_a_bad_server_or_scheduler_number_fails_in_one_line(tiny_model_dir: Path, flag: str, value: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # in this process: each is refused before anything binds or the weights load
    from flashllm.cli import main

    code = main(["serve", str(tiny_model_dir), flag, value, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == USAGE_ERROR and "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("flashllm serve: ") and flag.lstrip("-").replace("-", "_") in line.replace("-", "_"), line
    assert WEIGHTS_LOADED not in err


@pytest.fixture(scope="module")
def other_vocabulary_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashllm.testing.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("other-vocab"), "llama", seed=4, tokenizer=False)


@pytest.mark.parametrize(("command", "args", "names"), [
    ("generate", ["--speculate_method", "bogus"], ("--speculate_method", "bogus")),
    ("generate", ["--speculate_max_ngram_size", "3"], ("--speculate_max_ngram_size", "need --speculate_method")),
    ("generate", ["--speculative-config", '{"method": "ngram", "foo": 1}'], ("unknown", "foo")),
    ("generate", ["--speculate_method", "ngram", "--speculate_max_draft_token_num", "100"],
     ("--speculate_max_draft_token_num", "100")),
    ("generate", ["--speculate_method", "draft_model", "--speculative-model", "OTHER"], ("vocab",)),
    ("serve", ["--speculate_method", "bogus"], ("--speculate_method", "bogus")),
])
def test_bad_speculation_settings_fail_in_one_line(tiny_model_dir: Path, other_vocabulary_dir: Path, command: str,
                                                   args: list[str], names: tuple[str, ...],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # issue 44's bad input: an unknown method, a draft count of 100, tuning flags without a method, a draft
    # model of another vocabulary; the last one loads the target first, the others fail before it
    from flashllm.cli import main

    args = [str(other_vocabulary_dir) if a == "OTHER" else a for a in args]
    head = ["generate", "hi", "--model", str(tiny_model_dir), "--max-tokens", "2"] if command == "generate" else \
        ["serve", str(tiny_model_dir), "--port", "1"]
    code = main([*head, *args, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == USAGE_ERROR and "Traceback" not in err, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"flashllm {command}: "), err[-2000:]
    for name in names:
        assert name in line, line
