"""--tensor-parallel-size / --distributed-executor-backend: every engine-building command parses them
and hands them to EngineConfig.parallel; bad values fail early with a message naming the flag."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import flashllm.llm
from flashllm.cli import build_parser, main
from flashllm.cli import serve as serve_cli
from flashllm.cli.parallel_flags import executor_backend, tensor_parallel_size
from flashllm.config import DISTRIBUTED_EXECUTOR_BACKENDS, EngineConfig
from flashllm.core.builder import EngineConfigError
from flashllm.core.parallel import (
    DEFAULT_HEARTBEAT_S,
    DIST_TIMEOUT_ENV,
    HEARTBEAT_ENV,
    dist_timeout,
    heartbeat_interval,
)
from flashllm.llm import engine_config

SPELLINGS = (["--tensor-parallel-size", "2"], ["--tensor_parallel_size", "2"], ["-tp", "2"])


class _Stop(Exception):
    """Raised by the stand-in LLM once it has built the command's EngineConfig."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """Replace LLM by one that builds the real EngineConfig from the command's keywords, then stops."""
    configs: list[EngineConfig] = []

    def fake_llm(model: str | None = None, **kwargs: Any) -> Any:
        configs.append(engine_config(model, **kwargs))
        raise _Stop

    monkeypatch.setattr(flashllm.llm, "LLM", fake_llm)
    return configs


# --- the library: engine_config, LLM, AutoModel ------------------------------------------------------

def test_engine_config_fills_the_parallel_group() -> None:
    config = engine_config("m", tensor_parallel_size=4, distributed_executor_backend="ray")
    assert (config.parallel.tensor_parallel_size, config.parallel.distributed_executor_backend) == (4, "ray")
    default = engine_config("m", tensor_parallel_size=None, distributed_executor_backend=None)
    assert (default.parallel.tensor_parallel_size, default.parallel.distributed_executor_backend) == (1, None)


@pytest.mark.parametrize("size", [0, -2, 1.5, "2", True])
def test_engine_config_refuses_a_bad_rank_count(size: Any) -> None:
    with pytest.raises(EngineConfigError, match=r"tensor_parallel_size must be a whole number of at least 1"):
        engine_config("m", tensor_parallel_size=size)


def test_engine_config_refuses_an_unknown_executor() -> None:
    with pytest.raises(EngineConfigError, match=r"'nccl' is not one of uniproc, mp, ray, external"):
        engine_config("m", distributed_executor_backend="nccl")


def test_uniproc_cannot_run_several_ranks() -> None:
    with pytest.raises(EngineConfigError, match=r"'uniproc' runs one rank.*tensor_parallel_size is 2"):
        engine_config("m", tensor_parallel_size=2, distributed_executor_backend="uniproc")
    assert engine_config("m", tensor_parallel_size=1, distributed_executor_backend="uniproc").parallel.tensor_parallel_size == 1


def test_llm_refuses_bad_values_before_building_an_engine() -> None:
    with pytest.raises(EngineConfigError, match="tensor_parallel_size"):
        flashllm.llm.LLM("no-such-dir", tensor_parallel_size=0)
    with pytest.raises(EngineConfigError, match="distributed_executor_backend"):
        flashllm.llm.LLM("no-such-dir", distributed_executor_backend="torchrun")


@pytest.mark.parametrize("value", ["soon", "", "0", "-1", "nan", "inf"])
def test_a_malformed_dist_timeout_is_a_configuration_error_naming_it(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DIST_TIMEOUT_ENV, value)
    with pytest.raises(EngineConfigError, match=f"{DIST_TIMEOUT_ENV}=.* must be a positive number of seconds"):
        dist_timeout()
    monkeypatch.setenv(DIST_TIMEOUT_ENV, "2.5")
    assert dist_timeout().total_seconds() == 2.5


@pytest.mark.parametrize("value", ["soon", "", "-1", "nan", "inf"])
def test_a_malformed_heartbeat_is_a_configuration_error_naming_it(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HEARTBEAT_ENV, value)
    with pytest.raises(EngineConfigError, match=f"{HEARTBEAT_ENV}=.* must be 0 \\(off\\) or a positive number"):
        heartbeat_interval()
    monkeypatch.setenv(HEARTBEAT_ENV, "0")
    assert heartbeat_interval() == 0.0  # off
    monkeypatch.delenv(HEARTBEAT_ENV)
    assert heartbeat_interval() == DEFAULT_HEARTBEAT_S


@pytest.mark.parametrize(("name", "need"), [(DIST_TIMEOUT_ENV, "a positive number of seconds"),
                                            (HEARTBEAT_ENV, "0 (off) or a positive number of seconds")])
def test_a_command_with_a_malformed_dist_setting_fails_in_one_line_before_any_rank_starts(
        name: str, need: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, "soon")
    assert main(["generate", "hello", "--model", "no-such-model", "-tp", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"flashllm generate: {name}='soon' must be {need}; fix or unset it", err


def test_llm_and_auto_model_hand_the_options_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.auto_model import AutoModel

    configs: list[EngineConfig] = []

    def fake_engine(config: EngineConfig) -> Any:
        configs.append(config)
        raise _Stop

    monkeypatch.setattr(flashllm.llm, "Engine", fake_engine)
    with pytest.raises(_Stop):
        flashllm.llm.LLM("m", tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(_Stop):
        AutoModel.from_pretrained(Path("m"), tensor_parallel_size=3)
    assert [(c.parallel.tensor_parallel_size, c.parallel.distributed_executor_backend) for c in configs] == \
        [(2, "mp"), (3, None)]


@given(st.integers(min_value=-1000, max_value=1000))
def test_the_rank_count_parser_accepts_exactly_the_positive_integers(n: int) -> None:
    if n >= 1:
        assert tensor_parallel_size(str(n)) == n
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
            tensor_parallel_size(str(n))


@given(st.text(max_size=12))
def test_the_executor_parser_accepts_exactly_the_four_backends(text: str) -> None:
    if text in DISTRIBUTED_EXECUTOR_BACKENDS:
        assert executor_backend(text) == text
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="must be one of uniproc, mp, ray, external"):
            executor_backend(text)


# --- the commands that build an LLM ------------------------------------------------------------------

def _rouge_data(tmp_path: Path) -> str:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"src": "hi", "tgt": "hello"}) + "\n")
    return str(data)


COMMANDS = {
    "predict": lambda tmp: ["predict", "--benchmark", "--output_file", str(tmp / "out.json")],
    "generate": lambda tmp: ["generate", "hello"],
    "bench throughput": lambda tmp: ["bench", "throughput", "--model", "m", "--max-model-len", "64"],
    "bench latency": lambda tmp: ["bench", "latency", "--model", "m", "--max-model-len", "64"],
    "eval rouge": lambda tmp: ["eval", "rouge", "--model", "m", "--data", _rouge_data(tmp)],
    "chat": lambda tmp: ["chat"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("size_flag", SPELLINGS, ids=lambda f: f[0])
def test_commands_hand_the_flags_to_engine_config(command: str, size_flag: list[str], tmp_path: Path,
                                                  built: list[EngineConfig]) -> None:
    argv = COMMANDS[command](tmp_path) + size_flag + ["--distributed-executor-backend", "mp"]
    try:
        main(argv)
    except _Stop:
        pass  # chat turns a failed load into an exit code; the others let the stand-in's stop through
    assert [(c.parallel.tensor_parallel_size, c.parallel.distributed_executor_backend) for c in built] == [(2, "mp")]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_default_to_one_rank_and_no_chosen_executor(command: str, tmp_path: Path,
                                                              built: list[EngineConfig]) -> None:
    try:
        main(COMMANDS[command](tmp_path))
    except _Stop:
        pass
    assert [(c.parallel.tensor_parallel_size, c.parallel.distributed_executor_backend,
             c.parallel.enable_expert_parallel) for c in built] == [(1, None, False)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("spelling", ["--enable-expert-parallel", "--enable_expert_parallel"])
def test_commands_hand_expert_parallelism_to_engine_config(command: str, spelling: str, tmp_path: Path,
                                                           built: list[EngineConfig]) -> None:
    try:
        main(COMMANDS[command](tmp_path) + ["-tp", "2", spelling])
    except _Stop:
        pass
    assert [c.parallel.enable_expert_parallel for c in built] == [True]


@pytest.mark.parametrize("command", sorted(COMMANDS) + ["serve", "eval ppl", "bench serve"])
@pytest.mark.parametrize(("flag", "expected"), [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be a whole number of at least 1"),
    (["-tp", "two"], "--tensor-parallel-size must be a whole number of at least 1"),
    (["--distributed_executor_backend", "nccl"], "--distributed-executor-backend must be one of uniproc, mp, ray"),
])
def test_bad_values_stop_the_parser_with_the_reason(command: str, flag: list[str], expected: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(command.split() + flag)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "flag"), [("ppl", "--tensor-parallel-size"), ("kl", "--baseline-tensor-parallel-size")])
def test_eval_scoring_refuses_several_ranks(mode: str, flag: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert main(["eval", mode, "--model", "m", "--text", str(text), flag, "2"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "one rank" in err and "eval rouge" in err


def test_static_predict_refuses_several_ranks(tmp_path: Path, built: list[EngineConfig], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["predict", "--benchmark", "--mode", "static", "--model_name_or_path", str(tmp_path), "-tp", "2"]) == 2
    assert re.search(r"--mode static .* drop --tensor_parallel_size", capsys.readouterr().err)
    assert built == []


# --- serve: flags, FLASHLLM_* variables, --config, and bench serve's started server ------------------

def _serve_options(argv: list[str], environ: dict[str, str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(["serve", *argv])
    return serve_cli.resolve_options(args, environ or {})


def _parallel(options: dict[str, Any]) -> tuple[Any, Any]:
    return options["tensor_parallel_size"], options["distributed_executor_backend"]


@pytest.mark.parametrize("size_flag", SPELLINGS, ids=lambda f: f[0])
def test_serve_flags_reach_the_engine_config(size_flag: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.serving import server

    options = _serve_options([*size_flag, "--distributed_executor_backend", "ray"])
    monkeypatch.setattr(server, "Engine", lambda config: config)
    parallel = server._build_engine(options).parallel
    assert (parallel.tensor_parallel_size, parallel.distributed_executor_backend) == (2, "ray")
    assert _parallel(_serve_options([])) == (1, None)


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["--enable-expert-parallel"], {}, True), (["--enable_expert_parallel"], {}, True), ([], {}, False),
    ([], {"FLASHLLM_ENABLE_EXPERT_PARALLEL": "true"}, True), ([], {"FLASHLLM_ENABLE_EXPERT_PARALLEL": "0"}, False),
])
def test_serve_hands_expert_parallelism_to_the_engine_config(argv: list[str], environ: dict[str, str], expected: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.serving import server

    options = _serve_options(["-tp", "2", *argv], environ)
    monkeypatch.setattr(server, "Engine", lambda config: config)
    assert server._build_engine(options).parallel.enable_expert_parallel is expected


def test_serve_static_mode_refuses_expert_parallelism() -> None:
    with pytest.raises(SystemExit, match="--enable-expert-parallel configure the paged engine"):
        _serve_options(["--mode", "static", "--enable-expert-parallel"])


def test_serve_reads_the_environment_and_the_config_file_below_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"tensor-parallel-size": 4, "distributed_executor_backend": "ray"}))
    env = {"FLASHLLM_TENSOR_PARALLEL_SIZE": "3", "FLASHLLM_DISTRIBUTED_EXECUTOR_BACKEND": "external"}
    assert _parallel(_serve_options(["--config", str(config)])) == (4, "ray")
    assert _parallel(_serve_options(["--config", str(config)], env)) == (3, "external")
    assert _parallel(_serve_options(["--config", str(config), "-tp", "2", "--distributed-executor-backend", "mp"],
                                    env)) == (2, "mp")


@pytest.mark.parametrize(("source", "value", "expected"), [
    ("env", {"FLASHLLM_TENSOR_PARALLEL_SIZE": "0"}, r"FLASHLLM_TENSOR_PARALLEL_SIZE='0'.*at least 1"),
    ("env", {"FLASHLLM_DISTRIBUTED_EXECUTOR_BACKEND": "gloo"}, r"FLASHLLM_DISTRIBUTED_EXECUTOR_BACKEND='gloo'.*one of"),
    ("yaml", {"tensor_parallel_size": 2.5}, r"--config tensor_parallel_size='2.5'.*at least 1"),
    ("yaml", {"tensor_parallel_size": True}, r"--config tensor_parallel_size.*at least 1"),
    ("yaml", {"distributed-executor-backend": "slurm"}, r"--config distributed_executor_backend='slurm'.*one of"),
])
def test_serve_refuses_bad_values_from_the_environment_or_config(source: str, value: dict[str, Any], expected: str,
                                                                 tmp_path: Path) -> None:
    argv: list[str] = []
    environ: dict[str, str] = {}
    if source == "env":
        environ = value
    else:
        config = tmp_path / "serve.yaml"
        config.write_text(yaml.safe_dump(value))
        argv = ["--config", str(config)]
    with pytest.raises(SystemExit, match=expected):
        _serve_options(argv, environ)


def test_serve_static_mode_refuses_the_parallel_flags() -> None:
    with pytest.raises(SystemExit, match="--tensor-parallel-size configure the paged engine"):
        _serve_options(["--mode", "static", "--tensor-parallel-size", "2"])


def test_bench_serve_passes_the_flags_to_the_server_it_starts() -> None:
    from flashllm.bench.serve_run import _server_args

    args = build_parser().parse_args(["bench", "serve", "-tp", "2", "--distributed-executor-backend", "mp"])
    passed = _server_args(args)
    assert _parallel(_serve_options(passed)) == (2, "mp")
    assert _server_args(build_parser().parse_args(["bench", "serve"])) == []  # nothing given: the server's defaults
    expert = _server_args(build_parser().parse_args(["bench", "serve", "-tp", "2", "--enable-expert-parallel"]))
    assert _serve_options(expert)["enable_expert_parallel"] is True


def test_the_documented_commands_parse_and_ask_for_two_ranks() -> None:
    import shlex

    page = (Path(__file__).resolve().parents[2] / "docs" / "parallel.md").read_text()
    script = page.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in script.splitlines() if line.strip()]
    commands = [c for c in commands if c]
    argvs = [c[c.index("flashllm") + 1:] for c in commands]
    assert len(argvs) == 2 and commands[1][0] == "torchrun"
    for argv in argvs:
        assert build_parser().parse_args(argv).tensor_parallel_size == 2
