"""`flashllm chat` in a pseudo-terminal: in-process and against a real server, replies checked by other paths."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

pexpect = pytest.importorskip("pexpect")

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.chat_session import ChatError, ChatSession, ChatSettings, _sse_delta  # noqa: E402
from flashllm.cli import chat as chat_cli  # noqa: E402
from flashllm.testing.server import ServerProcess, free_port, running_server  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

MAX_TOKENS = 12
API_KEY = "chat-test-key"
TIMEOUT = 90  # seconds per expect: generous, CI machines are shared
Spawn = Callable[..., "pexpect.spawn"]
ENV = {**os.environ, "TERM": "dumb", "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a long context, so that an unbounded greedy reply runs long enough to be stopped with Ctrl-C
    return build_tiny_model(tmp_path_factory.mktemp("chat"), "qwen2", seed=0, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    pytest.importorskip("fastapi")
    with running_server([str(model_dir), "--max-model-len", "4096", "--device", "cpu", "--api-key", API_KEY]) as srv:
        yield srv


def _shown(text: str) -> str:
    """How the chat should show model text on a terminal: control characters made visible, CRLF line ends."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in "\n\t" or 0x20 <= code < 0x7F or code >= 0xA0:
            out.append(ch)
        elif code < 0x20:
            out.append(chr(0x2400 + code))  # the Unicode "control pictures" block
        else:
            out.append("\u2421" if code == 0x7F else "\ufffd")
    return "".join(out).replace("\n", "\r\n")


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """`spawn(*chat_args)` starts the chat in a pseudo-terminal and waits for its first prompt."""
    children: list[pexpect.spawn] = []

    def start(*args: str) -> pexpect.spawn:
        child = pexpect.spawn(sys.executable, ["-m", "flashllm.cli.chat", *args], env=ENV, encoding="utf-8",
                              codec_errors="replace", timeout=TIMEOUT, dimensions=(40, 200))
        children.append(child)
        child.expect_exact(">>> ")
        return child

    yield start
    for child in children:  # a failed test must not leave a chat process behind
        if child.isalive():
            child.terminate(force=True)


def _ask(child: pexpect.spawn, text: str) -> str:
    """Send one line and return what was printed before the next prompt (without the trailing blank line)."""
    child.sendline(text)
    child.expect_exact(text + "\r\n")
    child.expect_exact("\r\n\r\n>>> ")
    return child.before


def _command(child: pexpect.spawn, line: str, answer: str) -> None:
    """Run a slash command and wait for its answer and the next prompt (typing ahead would race)."""
    child.sendline(line)
    child.expect_exact(answer)
    child.expect_exact(">>> ")


def _bye(child: pexpect.spawn) -> int:
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def _reference(llm: LLM, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


def test_in_process_chat_matches_llm_chat_and_obeys_commands(spawn: Spawn, model_dir: Path, llm: LLM) -> None:
    child = spawn(str(model_dir), "--device", "cpu", "--max-tokens", str(MAX_TOKENS))
    _command(child, "/set temperature 0", "(set temperature = 0.0)")
    first = [{"role": "user", "content": "hello there"}]
    reply = _ask(child, "hello there")
    expected = _reference(llm, first)
    assert expected and reply == _shown(expected)
    # the second turn sends the whole conversation, the first reply included
    second = [*first, {"role": "assistant", "content": expected}, {"role": "user", "content": "why?"}]
    assert _ask(child, "why?") == _shown(_reference(llm, second))

    _command(child, "/set temperature abc", "error: temperature must be a number, got 'abc'")
    _command(child, "/clear", "(conversation cleared)")
    assert _ask(child, "hello there") == reply  # greedy, fresh history: the same answer again

    _command(child, "/clear", "(conversation cleared)")
    for line in ('"""', "line one"):  # wait for each continuation prompt: typing ahead would race
        child.sendline(line)
        child.expect_exact(line + "\r\n... ")
    child.sendline('line two"""')
    child.expect_exact("line two\"\"\"\r\n")
    child.expect_exact("\r\n\r\n>>> ")
    assert child.before == _shown(_reference(llm, [{"role": "user", "content": "line one\nline two"}]))

    # Ctrl-C between engine steps: the reply (unbounded: up to the 4096-token context) stops, its
    # request is aborted, and the engine keeps working
    _command(child, "/set max_tokens default", "(set max_tokens = default)")
    _stop_a_long_reply(child, "hello there")
    _command(child, "/clear", "(conversation cleared)")
    _command(child, "/set max_tokens 8", "(set max_tokens = 8)")
    assert _ask(child, "hello there") == _shown(_reference(llm, [{"role": "user", "content": "hello there"}], 8))
    child.sendeof()  # Ctrl-D leaves too
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def _stop_a_long_reply(child: pexpect.spawn, question: str) -> None:
    child.sendline(question)
    child.expect_exact(question + "\r\n")
    child.expect(r"\S")  # the reply has started streaming
    child.sendintr()
    child.expect_exact("(reply stopped)")
    child.expect_exact(">>> ")


def test_url_mode_matches_the_servers_non_streamed_answer(spawn: Spawn, server: ServerProcess) -> None:
    system = "You are terse."
    child = spawn("--url", server.url, "--api-key", API_KEY, "--system", system, "--temperature", "0",
                   "--max-tokens", str(MAX_TOKENS))
    model = httpx.get(f"{server.url}/models", headers=_auth()).json()["data"][0]["id"]
    messages = [{"role": "system", "content": system}]
    for question in ("hello there", "and then?"):
        messages.append({"role": "user", "content": question})
        reply = _ask(child, question)
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
        answer = httpx.post(f"{server.url}/chat/completions", json=body, headers=_auth(), timeout=TIMEOUT)
        expected = answer.json()["choices"][0]["message"]["content"]
        assert expected and reply == _shown(expected)
        messages.append({"role": "assistant", "content": expected})
    # Ctrl-C closes the stream; the server sees the disconnect and aborts the request
    _command(child, "/set max_tokens default", "(set max_tokens = default)")
    _stop_a_long_reply(child, "tell me more")
    _wait_for_abort(server)
    # a 4xx from the server is one error line, and the chat goes on
    _command(child, "/set max_tokens 100000", "(set max_tokens = 100000)")
    child.sendline("one more")
    child.expect(r"error: the server answered 400: [^\r\n]*max_tokens[^\r\n]*\r\n")
    assert "Traceback" not in child.before
    assert _bye(child) == 0


def _wait_for_abort(server: ServerProcess, timeout: float = 30.0) -> None:
    """Poll /metrics until a request was counted as aborted and none is running."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(f"{server.base_url}/metrics", headers=_auth()).text
        aborted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("flashllm:requests_aborted_total"))
        running = [line for line in metrics.splitlines() if line.startswith("flashllm:num_requests_running")]
        if aborted >= 1 and running and float(running[0].rsplit(" ", 1)[1]) == 0:
            return
        assert time.monotonic() < deadline, f"the server did not abort the stopped reply:\n{metrics}"
        time.sleep(0.2)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _start_and_fail(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run `flashllm chat *args` in this process; it must exit 1 with exactly one error line."""
    parser = argparse.ArgumentParser(prog="flashllm")
    chat_cli.add_parser(parser.add_subparsers(dest="command"))
    assert chat_cli.run(parser.parse_args(["chat", *args])) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_url_mode_start_errors_are_one_line(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert "answered 401" in _start_and_fail(capsys, "--url", server.url, "--api-key", "not-the-key")
    assert "cannot reach" in _start_and_fail(capsys, "--url", f"http://127.0.0.1:{free_port()}/v1")
    assert "does not serve" in _start_and_fail(capsys, "--url", server.url, "--api-key", API_KEY, "--model", "x")


def test_a_model_without_chat_template_is_refused_with_a_hint(model_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.name not in ("chat_template.jinja", "tokenizer_config.json"):
            (bare / f.name).write_bytes(f.read_bytes())
    err = _start_and_fail(capsys, str(bare), "--device", "cpu")
    assert "chat template" in err and "--chat-template" in err
    assert "is neither" in _start_and_fail(capsys, str(bare), "--chat-template", str(tmp_path / "missing.jinja"))


def test_chat_parses_as_a_flashllm_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="flashllm")
    chat_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat", "m", "--top-p", "0.5", "--max-tokens", "9", "--seed", "2", "--system", "s",
                              "--dtype", "float32", "--max-model-len", "128"])
    assert (args.command, args.model_dir, args.top_p, args.max_tokens, args.seed) == ("chat", "m", 0.5, 9, 2)
    assert (args.system, args.dtype, args.max_model_len, args.url) == ("s", "float32", 128, None)


# ---------------------------------------------------------------- pure parts, no process

_plain_line = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=20).filter(
    lambda s: '"' not in s)


@given(st.lists(_plain_line, min_size=1, max_size=6))
def test_triple_quoted_block_joins_its_lines(lines: list[str]) -> None:
    feed = iter([*lines, '"""'])
    assert chat_cli.read_multiline('"""', lambda: next(feed)) == "\n".join(lines)
    feed = iter(lines[1:])
    joined = chat_cli.read_multiline('"""' + lines[0] + '"""', lambda: next(feed))
    assert joined == lines[0]


def test_unfinished_block_ends_at_eof_and_plain_lines_pass_through() -> None:
    def eof() -> str:
        raise EOFError
    assert chat_cli.read_multiline('"""a', eof) == "a"
    assert chat_cli.read_multiline('say """hi"""', eof) == 'say """hi"""'


@pytest.mark.parametrize(("line", "fragment"), [
    ("/set temperature abc", "must be a number"), ("/set temperature -1", "temperature must be in"),
    ("/set top_p 0", "top_p must be in"), ("/set max_tokens 1.5", "must be an integer"),
    ("/set seed -2", "seed must be in"), ("/set colour red", "unknown setting"), ("/set top_p", "needs a value"),
    ("/frobnicate", "unknown command"),
])
def test_bad_commands_report_and_change_nothing(line: str, fragment: str) -> None:
    session = ChatSession()
    before = ChatSettings(**vars(session.settings))
    result = session.command(line)
    assert result.error and fragment in result.text and not result.exit
    assert session.settings == before


def test_set_and_reset_settings_reach_the_request() -> None:
    session = ChatSession()
    for line in ("/set temperature 0.7", "/set top_p 0.9", "/set max_tokens 64", "/set seed 1"):
        assert not session.command(line).error
    assert session.settings.overrides() == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "seed": 1}
    session.command("/set seed default")
    assert "seed" not in session.settings.overrides()
    with pytest.raises(ChatError):
        ChatSettings(top_p=2.0)
    assert session.command("/bye").exit


def test_history_system_prompt_and_clear() -> None:
    session = ChatSession()
    session.command("/set system Be brief.")
    session.history.add_exchange("a", "b")
    assert [m["role"] for m in session.history.messages("c")] == ["system", "user", "assistant", "user"]
    session.command("/clear")
    assert session.history.messages("c") == [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "c"}]


def test_sse_lines() -> None:
    assert _sse_delta('data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}') == "hi"
    assert _sse_delta('data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}') == ""
    assert _sse_delta('data: {"choices": [], "usage": {}}') == ""
    assert _sse_delta(": keep-alive") == ""
    assert _sse_delta("data: [DONE]") is None
    with pytest.raises(ChatError, match="overloaded"):
        _sse_delta('data: {"error": {"message": "overloaded"}}')
