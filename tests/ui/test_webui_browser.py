"""The chat page in a real headless Chromium against the real server, and its HTTP client on its own."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.serving.webui import APIError, ChatClient, Message, chat_turn, iter_sse_data, list_models
from flashllm.testing.server import ServerProcess, free_port

if TYPE_CHECKING:
    from conftest import ChatPage  # tests/ui/conftest.py

    OpenChat = Callable[[str], ChatPage]
    Greedy = Callable[[list[Message], int], str]


# ---- the HTTP client, against stand-in transports (no gradio, no browser) ----

def _stream_transport(body_chunks: list[bytes], status: int = 200, seen: list[httpx.Request] | None = None
                      ) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)

        async def chunks() -> AsyncIterator[bytes]:
            for chunk in body_chunks:
                yield chunk
        return httpx.Response(status, content=chunks())
    return httpx.MockTransport(handler)


def _collect(client: ChatClient, messages: list[Message], **params: Any) -> list[str]:
    async def run() -> list[str]:
        sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8, **params}
        return [delta async for delta in client.stream_chat(messages, **sampling)]
    return asyncio.run(run())


def _sse(payloads: list[str], newline: str = "\n") -> str:
    return "".join(f"data: {p}{newline}{newline}" for p in payloads)


def _chunk(delta: str) -> str:
    return json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": delta}}]},
                      ensure_ascii=False)


def test_sse_events_follow_the_spec() -> None:
    stream = ": comment\nevent: x\ndata: a\r\ndata:b\r\n\r\n\nid: 3\rdata:  two\u2028spaces\x85\r\rdata: cut"
    expected = ["a\nb", " two\u2028spaces\x85"]
    assert list(iter_sse_data([stream])) == expected
    assert list(iter_sse_data(stream)) == expected  # one character at a time: every CRLF is cut in two


@settings(max_examples=60, deadline=None)
@given(deltas=st.lists(st.text(max_size=6), max_size=6), cuts=st.lists(st.integers(0, 4096), max_size=6),
       newline=st.sampled_from(["\n", "\r\n", "\r"]))
def test_stream_yields_every_delta_however_the_bytes_are_cut(deltas: list[str], cuts: list[int], newline: str) -> None:
    body = (f": keep-alive{newline}{newline}" + _sse([_chunk(d) for d in deltas] + ["[DONE]"], newline)).encode()
    bounds = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    seen: list[httpx.Request] = []
    client = ChatClient("http://api.test/v1/", "m", api_key="k",
                        transport=_stream_transport([body[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], seen=seen))
    assert _collect(client, [{"role": "user", "content": "q"}], max_tokens=5) == [d for d in deltas if d]
    request = seen[0]
    assert str(request.url) == "http://api.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer k"
    assert json.loads(request.content) == {"model": "m", "messages": [{"role": "user", "content": "q"}],
                                           "stream": True, "temperature": 0.0, "top_p": 1.0, "max_tokens": 5}


@pytest.mark.parametrize(("status", "body", "needle"), [
    (401, '{"error": {"message": "a valid API key is required", "type": "auth"}}', "HTTP 401: a valid API key"),
    (503, "overloaded", "HTTP 503: overloaded"),
    (200, _sse([_chunk("partial")]), "before `data: [DONE]`"),
    (200, _sse(['{"error": {"message": "engine died", "code": "internal_error"}}']), "mid-stream: engine died"),
    (200, _sse(["not json"]), "not JSON"),
])
def test_stream_failures_raise_api_error_with_the_reason(status: int, body: str, needle: str) -> None:
    client = ChatClient("http://api.test/v1", "m", transport=_stream_transport([body.encode()], status))
    with pytest.raises(APIError, match=re.escape(needle)):
        _collect(client, [{"role": "user", "content": "q"}])


def test_unreachable_server_is_an_api_error() -> None:
    client = ChatClient(f"http://127.0.0.1:{free_port()}/v1", "m")
    with pytest.raises(APIError, match="could not talk to"):
        _collect(client, [{"role": "user", "content": "q"}])
    with pytest.raises(APIError, match="could not talk to"):
        list_models(client.base_url)


def test_list_models_sends_the_key_and_reports_refusals() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(401, json={"error": {"message": "bad key", "type": "authentication_error"}})
        return httpx.Response(200, json={"object": "list", "data": [{"id": "a"}, {"id": "b"}]})
    transport = httpx.MockTransport(handler)
    assert list_models("http://api.test/v1", "k", transport=transport) == ["a", "b"]
    with pytest.raises(APIError, match="HTTP 401: bad key"):
        list_models("http://api.test/v1", "wrong", transport=transport)


def _turn(body: str, history: list[Message], display: list[Message]) -> list[tuple[list[Message], list[Message]]]:
    client = ChatClient("http://api.test/v1", "m", transport=_stream_transport([body.encode()]))

    async def run() -> list[tuple[list[Message], list[Message]]]:
        turn = chat_turn(client, "next", history, display, temperature=0.0, top_p=1.0, max_tokens=4)
        return [(h, d) async for h, d in turn]
    return asyncio.run(run())


def test_chat_turn_grows_the_reply_and_records_a_completed_exchange() -> None:
    old = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    steps = _turn(_sse([_chunk("he"), _chunk("llo"), "[DONE]"]), old, old)
    user = {"role": "user", "content": "next"}
    assert [d[-1]["content"] for _, d in steps] == ["next", "he", "hello", "hello"]
    assert steps[-1] == ([*old, user, {"role": "assistant", "content": "hello"}],) * 2
    assert old == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]  # not mutated


def test_chat_turn_shows_an_error_but_keeps_it_out_of_the_history() -> None:
    old: list[Message] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    history, display = _turn(_sse([_chunk("half")]), old, old)[-1]
    assert history == old
    assert display[:-1] == [*old, {"role": "user", "content": "next"}]
    assert display[-1]["content"].startswith("half") and "Error from the server" in display[-1]["content"]


def test_chat_turn_stops_reading_when_asked() -> None:
    pulled: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            for i, piece in enumerate(["a", "b", "c", "d"]):
                pulled.append(i)
                yield _sse([_chunk(piece)]).encode()
            yield _sse(["[DONE]"]).encode()
        return httpx.Response(200, content=chunks())

    client = ChatClient("http://api.test/v1", "m", transport=httpx.MockTransport(handler))

    async def run() -> list[tuple[list[Message], list[Message]]]:
        turn = chat_turn(client, "q", [], [], temperature=0.0, top_p=1.0, max_tokens=4,
                         should_stop=lambda: len(pulled) >= 2)
        return [step async for step in turn]
    history, display = asyncio.run(run())[-1]
    assert history == display == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
    assert pulled == [0, 1]  # the stream was closed, not read to the end


def test_missing_gradio_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from flashllm.cli import webui as cli_webui
    from flashllm.serving.webui import mount_webui

    monkeypatch.setitem(sys.modules, "gradio", None)  # makes `import gradio` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'flashllm\[ui\]'"):
        mount_webui(None, "http://127.0.0.1:1/v1", "m", None)  # type: ignore[arg-type]
    args = argparse.Namespace(url="http://127.0.0.1:1/v1", api_key=None, model="m", host="127.0.0.1", port=1)
    assert cli_webui.run(args) == 1
    assert "pip install 'flashllm[ui]'" in capsys.readouterr().err


# ---- the page in Chromium, against the real server (fixtures in conftest.py) ----

def test_page_streams_the_greedy_reply_keeps_history_and_clears(open_chat: OpenChat, server: ServerProcess,
                                                                 greedy: Greedy) -> None:
    chat = open_chat(f"{server.base_url}/ui/")
    chat.set_slider("temperature", 0)
    chat.set_slider("max-tokens", 24)
    seen = chat.watch_bot_text()
    first = chat.send("Hello there")
    turn1 = [{"role": "user", "content": "Hello there"}]
    assert first == greedy(turn1, 24)
    partial = [s for s in dict.fromkeys(seen()) if s != first]
    assert partial, "the reply arrived in one piece: the page did not stream"
    assert all(first.startswith(s) for s in partial), partial
    if first.strip():
        assert chat.page.locator(chat.BOT).last.inner_text().strip(), "the reply is not visible"

    second = chat.send("Tell me more")
    turn2 = [*turn1, {"role": "assistant", "content": first}, {"role": "user", "content": "Tell me more"}]
    assert second == greedy(turn2, 24)

    chat.widget("clear").click()
    chat.expect(chat.page.locator(f"{chat.BOT}, {chat.USER}")).to_have_count(0)
    assert chat.send("Tell me more", press_enter=True) == greedy([{"role": "user", "content": "Tell me more"}], 24)


def test_page_shows_server_errors_and_keeps_working(open_chat: OpenChat, server: ServerProcess,
                                                    greedy: Greedy) -> None:
    chat = open_chat(f"{server.base_url}/ui/")
    chat.set_slider("temperature", 0)
    chat.set_slider("max-tokens", 4096)  # more than --max-model-len 512 leaves room for: the server says 400
    refused = httpx.post(f"{server.url}/chat/completions", timeout=60, json={
        "model": list_models(server.url)[0], "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "top_p": 1.0, "max_tokens": 4096, "stream": True})
    assert refused.status_code == 400
    assert f"HTTP 400: {refused.json()['error']['message']}" in chat.send("hi", press_enter=True)
    chat.set_slider("max-tokens", 8)
    # The failed exchange must not be resent: the answer is that of a fresh conversation.
    assert chat.send("hi") == greedy([{"role": "user", "content": "hi"}], 8)


def test_stop_ends_the_reply_and_keeps_what_arrived(open_chat: OpenChat, server: ServerProcess,
                                                    greedy: Greedy) -> None:
    chat = open_chat(f"{server.base_url}/ui/")
    chat.set_slider("temperature", 0)
    chat.set_slider("max-tokens", 450)
    prompt = [{"role": "user", "content": "Write a long story."}]
    full = greedy(prompt, 450)
    # Click Stop the moment it is enabled: the tiny model writes 450 tokens in about a second, too
    # little time to be sure a click polled from Python lands before the reply is complete.
    chat.page.evaluate("""() => { const stop = document.querySelector('#flashllm-stop');
      const clear = document.querySelector('#flashllm-clear');
      const observer = new MutationObserver(() => { if (!stop.disabled) {
        observer.disconnect(); window.clearWasOff = clear.disabled; stop.click(); } });
      observer.observe(stop, {attributes: true}); }""")
    chat.type(prompt[0]["content"])
    chat.widget("send").click()
    chat.expect(chat.page.locator(chat.BOT)).to_have_count(1, timeout=60_000)
    chat.expect(chat.widget("send")).to_be_enabled(timeout=60_000)
    chat.expect(chat.widget("stop")).to_be_disabled()
    partial = chat.last_reply()
    assert partial and full.startswith(partial) and len(partial) < len(full), (partial, full)
    assert chat.page.evaluate("window.clearWasOff"), "Clear was usable while the reply streamed"
    # The stopped reply is the assistant's turn in the history the next request carries.
    chat.set_slider("max-tokens", 8)
    turn2 = [*prompt, {"role": "assistant", "content": partial}, {"role": "user", "content": "Go on."}]
    assert chat.send("Go on.") == greedy(turn2, 8)


def test_standalone_webui_talks_to_the_server(open_chat: OpenChat, standalone_webui: str, model_dir: Path,
                                             greedy: Greedy) -> None:
    chat = open_chat(standalone_webui)
    chat.expect(chat.page.get_by_text(f"Chat with {model_dir.name}")).to_be_visible()  # name from /v1/models
    chat.set_slider("temperature", 0)
    chat.set_slider("max-tokens", 12)
    assert chat.send("Name a colour.") == greedy([{"role": "user", "content": "Name a colour."}], 12)
