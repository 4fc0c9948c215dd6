"""A gradio chat page that streams replies from an OpenAI-compatible API (`serve --ui`, `flashllm webui`)."""

from __future__ import annotations

import codecs
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import fastapi
    import gradio

Message = dict[str, str]  # {"role": "user" | "assistant", "content": text}

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_TOKENS = 256
# How long to wait for the next streamed chunk; a long prefill under load can be slow to start.
READ_TIMEOUT_S = 600.0
# gradio 6 takes chat content as typed parts, shown verbatim (a plain string is dedented and stripped).
MIN_GRADIO_MAJOR = 6
ELEM_PREFIX = "flashllm"

_LINE_END = re.compile(r"\r\n|\r|\n")


class APIError(RuntimeError):
    """The API could not be reached, answered with an error, or broke off a stream."""


def import_gradio() -> ModuleType:
    """Import gradio (6 or newer), or raise ImportError naming the extra to install."""
    try:
        import gradio
    except ImportError as exc:
        raise ImportError("the web UI needs gradio, which is not installed; "
                          "install it with: pip install 'flashllm[ui]'") from exc
    major = int(gradio.__version__.split(".")[0])
    if major < MIN_GRADIO_MAJOR:
        raise ImportError(f"the web UI needs gradio>={MIN_GRADIO_MAJOR}, found {gradio.__version__}; "
                          "upgrade it with: pip install -U 'flashllm[ui]'")
    return gradio


class SSEDecoder:
    """Turns the text of a server-sent event stream, in pieces of any size, into event payloads.

    Lines end only at CRLF, LF or CR (the SSE rule; str.splitlines would also cut at U+0085 or
    U+2028, which JSON may carry unescaped). Several `data:` lines of one event are joined with
    "\\n"; comments (":") and other fields are skipped; a blank line ends an event.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._tail = ""

    def feed(self, text: str) -> list[str]:
        """Take the next piece of the stream; return the payloads of the events it completes."""
        buffer = self._tail + text
        # A CR at the end may be the first half of a CRLF cut between pieces: keep it for later.
        held_cr = buffer.endswith("\r")
        lines = _LINE_END.split(buffer[:-1] if held_cr else buffer)
        self._tail = lines.pop() + ("\r" if held_cr else "")
        payloads = []
        for line in lines:
            if not line:
                if self._data:
                    payloads.append("\n".join(self._data))
                self._data = []
                continue
            field, _, value = line.partition(":")
            if field == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
        return payloads

    def close(self) -> list[str]:
        """The stream ended: a CR held back ends its line after all; return what that completes."""
        return self.feed("\n") if self._tail.endswith("\r") else []


def iter_sse_data(pieces: Iterable[str]) -> Iterator[str]:
    """The data payload of each complete event in the stream text `pieces`; an unfinished last event is dropped."""
    decoder = SSEDecoder()
    for piece in pieces:
        yield from decoder.feed(piece)
    yield from decoder.close()


def error_message(status_code: int, body: str) -> str:
    """A one-line description of an HTTP error, using the OpenAI `{"error": {"message"}}` when present."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.strip() or httpx.codes.get_reason_phrase(status_code)
    return f"HTTP {status_code}: {message}"


@dataclass
class ChatClient:
    """Talks to `{base_url}/chat/completions` of one model; `transport` lets tests stand in for the network."""

    base_url: str
    model: str
    api_key: str | None = None
    transport: httpx.AsyncBaseTransport | None = None

    def headers(self) -> dict[str, str]:
        """The bearer header when a key is set."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def stream_chat(self, messages: list[Message], *, temperature: float, top_p: float,
                          max_tokens: int) -> AsyncIterator[str]:
        """Yield the text deltas of a streamed chat completion for `messages`.

        Raises APIError when the server is unreachable, answers with an error status or an
        error event, or closes the stream before `data: [DONE]`.
        """
        url = f"{self.base_url.rstrip('/')}/chat/completions"
        body = {"model": self.model, "messages": messages, "stream": True, "temperature": temperature,
                "top_p": top_p, "max_tokens": max_tokens}
        timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
        try:
            async with httpx.AsyncClient(transport=self.transport, timeout=timeout) as client:
                async with client.stream("POST", url, json=body, headers=self.headers()) as response:
                    if response.status_code >= 400:
                        raise APIError(error_message(response.status_code, (await response.aread()).decode(errors="replace")))
                    async for delta in _chat_deltas(response):
                        yield delta
        except httpx.HTTPError as exc:
            raise APIError(f"could not talk to {url}: {exc!r}; is the server running?") from exc


async def _sse_payloads(response: httpx.Response) -> AsyncIterator[str]:
    decoder = SSEDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # SSE is always UTF-8
    async for raw in response.aiter_bytes():
        for payload in decoder.feed(utf8.decode(raw)):
            yield payload
    for payload in decoder.feed(utf8.decode(b"", final=True)) + decoder.close():
        yield payload


async def _chat_deltas(response: httpx.Response) -> AsyncIterator[str]:
    async with contextlib.aclosing(_sse_payloads(response)) as payloads:
        async for payload in payloads:
            if payload == "[DONE]":
                return
            try:
                chunk = json.loads(payload)
            except ValueError as exc:
                raise APIError(f"the server sent a stream chunk that is not JSON: {payload[:200]!r}") from exc
            text = _delta_text(chunk)
            if text:
                yield text
    raise APIError("the server closed the stream before `data: [DONE]`; the reply is cut short")


def _delta_text(chunk: dict[str, Any]) -> str:
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise APIError(f"the server failed mid-stream: {message}")
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in chunk.get("choices", []))


def list_models(base_url: str, api_key: str | None = None, transport: httpx.BaseTransport | None = None) -> list[str]:
    """The model ids that `GET {base_url}/models` lists; raises APIError on any failure."""
    url = f"{base_url.rstrip('/')}/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(transport=transport, timeout=10.0) as client:
            response = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise APIError(f"could not talk to {url}: {exc!r}; is the server running?") from exc
    if response.status_code >= 400:
        raise APIError(error_message(response.status_code, response.text))
    return [entry["id"] for entry in response.json().get("data", [])]


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


async def chat_turn(client: ChatClient, message: str, history: list[Message], display: list[Message], *,
                    temperature: float, top_p: float, max_tokens: int,
                    should_stop: Callable[[], bool] = lambda: False,
                    ) -> AsyncIterator[tuple[list[Message], list[Message]]]:
    """Stream one exchange, yielding `(history, display)` as the reply grows.

    `history` is what the API sees: completed exchanges only, so a failed one is not resent.
    `display` is what the page shows: the same plus error notes. When `should_stop()` turns
    true the stream is closed (the server then aborts the request) and the reply so far is
    kept as the answer. Inputs are not mutated.
    """
    user: Message = {"role": "user", "content": message}
    yield history, [*display, user]
    reply = ""
    try:
        async with contextlib.aclosing(client.stream_chat([*history, user], temperature=temperature, top_p=top_p,
                                                          max_tokens=max_tokens)) as deltas:
            async for delta in deltas:
                reply += delta
                yield history, [*display, user, _assistant(reply)]
                if should_stop():
                    break
    except APIError as exc:
        note = f"⚠️ **Error from the server:** {exc}"
        yield history, [*display, user, _assistant(f"{reply}\n\n{note}" if reply else note)]
        return
    yield [*history, user, _assistant(reply)], [*display, user, _assistant(reply)]


def to_chatbot(display: list[Message]) -> list[dict[str, Any]]:
    """`display` in gr.Chatbot's format: each content as one text part, so the text is shown verbatim."""
    return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in display]


def _widgets(gr: ModuleType, model: str) -> SimpleNamespace:
    """Lay out the page; elem_ids are `flashllm-<name>` so scripts and tests can find each widget."""
    gr.Markdown(f"### Chat with `{model}`")
    w = SimpleNamespace(chatbot=gr.Chatbot(label=model, height=460, elem_id=f"{ELEM_PREFIX}-chat"))
    with gr.Row():
        w.textbox = gr.Textbox(placeholder="Type a message, Enter to send", show_label=False, scale=8,
                               elem_id=f"{ELEM_PREFIX}-message")
        w.send = gr.Button("Send", variant="primary", scale=1, elem_id=f"{ELEM_PREFIX}-send")
        w.stop = gr.Button("Stop", scale=1, interactive=False, elem_id=f"{ELEM_PREFIX}-stop")
        w.clear = gr.Button("Clear", scale=1, elem_id=f"{ELEM_PREFIX}-clear")
    with gr.Row():
        w.temperature = gr.Slider(0.0, 2.0, value=DEFAULT_TEMPERATURE, step=0.05, label="Temperature",
                                  info="0 = greedy", elem_id=f"{ELEM_PREFIX}-temperature")
        w.top_p = gr.Slider(0.05, 1.0, value=DEFAULT_TOP_P, step=0.05, label="Top-p", elem_id=f"{ELEM_PREFIX}-top-p")
        w.max_tokens = gr.Slider(1, 4096, value=DEFAULT_MAX_TOKENS, step=1, label="Max tokens",
                                 elem_id=f"{ELEM_PREFIX}-max-tokens")
    return w


def build_webui(base_url: str, model: str, api_key: str | None = None) -> gradio.Blocks:
    """A gradio chat page for `model` that streams from `{base_url}/chat/completions`.

    `base_url` is the API root, e.g. `http://127.0.0.1:8000/v1`; `api_key` is sent as a bearer
    token. The page keeps the conversation per browser session and never touches an engine.
    """
    gr = import_gradio()
    client = ChatClient(base_url, model, api_key)

    def controls(busy: bool) -> tuple[Any, ...]:
        """Updates for (textbox, send, stop, clear): while a reply streams only Stop is live."""
        return (gr.update(interactive=not busy), gr.update(interactive=not busy), gr.update(interactive=busy),
                gr.update(interactive=not busy))

    async def on_send(message: str, history: list[Message], display: list[Message], temperature: float,
                      top_p: float, max_tokens: float, control: dict[str, bool]) -> AsyncIterator[tuple[Any, ...]]:
        if not message.strip():
            yield message, to_chatbot(display), history, display, *controls(False)[1:]
            return
        control["stop"] = False
        turn = chat_turn(client, message, history, display, temperature=float(temperature), top_p=float(top_p),
                         max_tokens=int(max_tokens), should_stop=lambda: control["stop"])
        busy_buttons = controls(True)[1:]
        async for new_history, new_display in turn:
            yield gr.update(value="", interactive=False), to_chatbot(new_display), new_history, new_display, *busy_buttons

    def on_stop(control: dict[str, bool]) -> None:
        control["stop"] = True  # the same dict the streaming on_send reads: gr.State passes it by reference

    with gr.Blocks(title=f"flashllm · {model}", analytics_enabled=False) as demo:
        w = _widgets(gr, model)
        history, display, control = gr.State([]), gr.State([]), gr.State({"stop": False})
        buttons = [w.send, w.stop, w.clear]
        # concurrency_limit=None: every browser session streams at once; the server batches them.
        reply = gr.on([w.send.click, w.textbox.submit], on_send,
                      [w.textbox, history, display, w.temperature, w.top_p, w.max_tokens, control],
                      [w.textbox, w.chatbot, history, display, *buttons], concurrency_limit=None)
        reply.then(lambda: controls(False), None, [w.textbox, *buttons])
        # Stop is a flag, not a gradio cancel: the reply then ends itself and keeps its text, and
        # Clear (disabled while streaming) never races a late update of the chat.
        w.stop.click(on_stop, [control], None)
        w.clear.click(lambda: ([], [], [], ""), None, [w.chatbot, history, display, w.textbox])
    return demo


def mount_webui(app: fastapi.FastAPI, base_url: str, model: str, api_key: str | None, path: str = "/ui") -> None:
    """Serve the chat page of build_webui() at `path` of `app` (call before the app starts)."""
    gr = import_gradio()
    gr.mount_gradio_app(app, build_webui(base_url, model, api_key), path=path)
