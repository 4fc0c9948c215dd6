"""Terminal chat logic: history, settings, slash commands, and the in-process and remote answerers."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from flashllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Message = dict[str, str]

# /set NAME VALUE: how each value is read from text before SamplingParams validates it
_PARSERS: dict[str, Callable[[str], Any]] = {"temperature": float, "top_p": float, "max_tokens": int, "seed": int}

HELP = """Commands:
  /set temperature T   sampling temperature (0 = greedy)
  /set top_p P         nucleus sampling mass in (0, 1]
  /set max_tokens N    longest reply in tokens
  /set seed S          seed for reproducible sampling
  /set NAME default    back to the default for NAME
  /set system TEXT     set the system prompt (clears the conversation)
  /set                 show the current settings (/show too)
  /set parameter NAME VALUE   Ollama's spelling (num_predict = max_tokens)
  /save FILE, /load FILE      write / read the conversation and settings (JSON)
  /clear               forget the conversation (the system prompt stays)
  /help                this text
  /bye                 leave (Ctrl-D too)
Ctrl-C stops a reply that is being written. Start and end a multi-line message with \"\"\"."""

# Ollama's /set parameter names that differ from ours
_OLLAMA_NAMES = {"num_predict": "max_tokens"}
MAX_SAVED_BYTES = 4 << 20

_CLEAR_HINT = "; /clear starts a new conversation, /set max_tokens N shortens replies"


class ChatError(Exception):
    """A failure to show the user as one line (bad command, unreachable server, ...); the chat goes on."""


@dataclass
class ChatSettings:
    """Sampling settings a chat sends with every turn; None = the model's (or server's) default."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        """Raise ChatError when SamplingParams would refuse a value."""
        try:
            SamplingParams(**self.overrides())
        except ValueError as exc:
            raise ChatError(str(exc)) from None

    def overrides(self) -> dict[str, Any]:
        """The settings that are set, as SamplingParams / OpenAI request fields."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def update(self, name: str, text: str) -> None:
        """Set `name` from user text ("default" resets it); ChatError names the problem, nothing changes."""
        if name not in _PARSERS:
            raise ChatError(f"unknown setting {name!r}; settable: {', '.join(_PARSERS)}, system")
        if text.strip().lower() in ("default", "none"):
            default = next(f for f in dataclasses.fields(self) if f.name == name).default
            setattr(self, name, default)
            return
        try:
            value = _PARSERS[name](text.strip())
        except ValueError:
            kind = "a number" if _PARSERS[name] is float else "an integer"
            raise ChatError(f"{name} must be {kind}, got {text.strip()!r}") from None
        dataclasses.replace(self, **{name: value})  # a copy, so a refused value changes nothing
        setattr(self, name, value)

    def describe(self) -> str:
        """One line per setting, "(default)" where unset."""
        return "\n".join(f"  {k} = {'(default)' if v is None else v}" for k, v in dataclasses.asdict(self).items())


@dataclass
class ChatHistory:
    """The conversation so far; every turn sends all of it (the model keeps no state)."""

    system: str | None = None
    turns: list[Message] = field(default_factory=list)

    def messages(self, user_text: str) -> list[Message]:
        """The whole conversation with `user_text` as the newest user message."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": user_text}]

    def add_exchange(self, user_text: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]

    def clear(self) -> None:
        self.turns.clear()


@dataclass
class CommandResult:
    """What a slash command did: text to show, whether it failed, whether the chat ends."""

    text: str = ""
    error: bool = False
    exit: bool = False


@dataclass
class ChatSession:
    """Settings plus history, and the slash commands that change them."""

    settings: ChatSettings = field(default_factory=ChatSettings)
    history: ChatHistory = field(default_factory=ChatHistory)

    @staticmethod
    def is_command(text: str) -> bool:
        return text.startswith("/")

    def command(self, line: str) -> CommandResult:
        """Run one slash command line (e.g. "/set top_p 0.9")."""
        name, _, rest = line.strip().partition(" ")
        name = name.lower()
        if name in ("/bye", "/exit", "/quit"):
            return CommandResult(exit=True)
        if name in ("/help", "/?"):
            return CommandResult(HELP)
        if name == "/clear":
            self.history.clear()
            return CommandResult("(conversation cleared)")
        if name in ("/save", "/load"):
            try:
                return self._save(rest.strip()) if name == "/save" else self._load(rest.strip())
            except ChatError as exc:
                return CommandResult(str(exc), error=True)
        if name == "/show":
            return self._set("")
        if name != "/set":
            return CommandResult(f"unknown command {name!r}; type /help for the list", error=True)
        try:
            return self._set(rest.strip())
        except ChatError as exc:
            return CommandResult(str(exc), error=True)

    def _set(self, rest: str) -> CommandResult:
        if not rest:
            system = self.history.system or "(none)"
            return CommandResult(f"{self.settings.describe()}\n  system = {system}")
        name, _, value = rest.partition(" ")
        if name == "parameter":  # Ollama: /set parameter NAME VALUE
            name, _, value = value.strip().partition(" ")
            name = _OLLAMA_NAMES.get(name, name)
        if name == "system":
            self.history.system = value.strip() or None
            self.history.clear()  # earlier replies answered another system prompt
            return CommandResult("(system prompt set; conversation cleared)")
        if not value.strip():
            raise ChatError(f"/set {name} needs a value, e.g. /set {name} default")
        self.settings.update(name, value)
        value = getattr(self.settings, name)
        return CommandResult(f"(set {name} = {'default' if value is None else value})")


    def _save(self, path: str) -> CommandResult:
        if not path:
            raise ChatError("/save needs a file name, e.g. /save chat.json")
        data = {"system": self.history.system, "turns": self.history.turns, "settings": self.settings.overrides()}
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
        except OSError as exc:
            raise ChatError(f"/save {path}: {exc.strerror or exc}") from None
        return CommandResult(f"(saved {len(self.history.turns)} messages to {path})")

    def _load(self, path: str) -> CommandResult:
        """Read a /save file back (plain JSON, bounded and checked); nothing changes when it is refused."""
        if not path:
            raise ChatError("/load needs a file name, e.g. /load chat.json")
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SAVED_BYTES + 1)
            data = json.loads(raw) if len(raw) <= MAX_SAVED_BYTES else None
        except (OSError, ValueError, RecursionError) as exc:
            raise ChatError(f"/load {path}: not a saved chat ({type(exc).__name__})") from None
        if not isinstance(data, dict):
            raise ChatError(f"/load {path}: not a saved chat (a JSON object of at most {MAX_SAVED_BYTES} bytes)")
        turns, system, settings = data.get("turns", []), data.get("system"), data.get("settings", {})
        ok_turns = isinstance(turns, list) and all(
            isinstance(t, dict) and set(t) == {"role", "content"} and t["role"] in ("user", "assistant")
            and isinstance(t["content"], str) for t in turns)
        if not ok_turns or not (system is None or isinstance(system, str)) or not isinstance(settings, dict):
            raise ChatError(f"/load {path}: not a saved chat (turns of user/assistant role and content strings)")
        unknown = set(settings) - set(_PARSERS)
        if unknown:
            raise ChatError(f"/load {path}: unknown settings {sorted(unknown)}")
        try:
            loaded = ChatSettings(**settings)
        except TypeError as exc:
            raise ChatError(f"/load {path}: {exc}") from None
        self.settings, self.history = loaded, ChatHistory(system, [dict(t) for t in turns])
        return CommandResult(f"(loaded {len(turns)} messages from {path})")


class InProcessResponder:
    """Answers by driving an in-process Engine step by step, so text streams as it is sampled.

    Ctrl-C must not land in the middle of `Engine.step()` (it would leave the scheduler half
    updated), so `defer_interrupt` asks the caller to turn it into the `stop` event, which is
    checked between steps.
    """

    defer_interrupt = True

    def __init__(self, llm: Any, chat_template: str | None = None, name: str = "") -> None:
        self.llm, self.chat_template, self.name = llm, chat_template, name
        self.llm.chat_template(chat_template)  # fail at start, not at the first message, without one

    def stream(self, messages: list[Message], settings: ChatSettings, stop: threading.Event) -> Iterator[str]:
        """Yield the reply's text deltas; the request is aborted if the caller stops early."""
        engine = self.llm.engine
        try:
            prompt = self.llm.render_chat(messages, self.chat_template)
        except ValueError as exc:  # the template refused these messages
            raise ChatError(str(exc)) from None
        if len(prompt) >= engine.max_model_len:
            raise ChatError(f"the conversation is {len(prompt)} tokens and the context {engine.max_model_len}, "
                            f"leaving no room for a reply{_CLEAR_HINT}")
        # max_tokens None: until EOS or a full context, as the server does
        overrides = {"max_tokens": None, **settings.overrides()}
        params = SamplingParams.from_generation_config(engine.parts.generation_config, **overrides)
        request_id = engine.add_request(prompt, params)
        finished = False
        try:
            while not finished and not stop.is_set() and engine.has_unfinished():
                for output in engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        if output.outputs[0].delta:
                            yield output.outputs[0].delta
        finally:
            if not finished:
                engine.abort(request_id)  # frees its KV blocks; a no-op once finished

    def close(self) -> None:
        """Nothing to release: the engine lives as long as the process."""


class RemoteResponder:
    """Answers through a server's OpenAI `/chat/completions` with `stream: true` (SSE).

    Leaving the stream early closes the connection and the server aborts the request, so a
    plain KeyboardInterrupt is a safe way to stop (`defer_interrupt` False).
    """

    defer_interrupt = False

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 300.0) -> None:
        self.url = normalize_api_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self.name = self._pick_model(model)

    def _pick_model(self, model: str | None) -> str:
        """`model`, or the first served one; asking /models first shows a bad URL or key at start."""
        body = self._checked(lambda: self.client.get("/models"))
        data = body.get("data") if isinstance(body, dict) else None
        served = [str(m["id"]) for m in data or [] if isinstance(m, dict) and "id" in m]
        if not served or (model is not None and model not in served):
            raise ChatError(f"the server does not serve {model or 'any model'}; /models lists: {served}")
        return model or served[0]

    def stream(self, messages: list[Message], settings: ChatSettings, stop: threading.Event) -> Iterator[str]:
        """Yield the reply's text deltas as the server streams them."""
        body = {"model": self.name, "messages": messages, "stream": True, **settings.overrides()}
        try:
            with self.client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ChatError(_status_message(response))
                for line in response.iter_lines():
                    delta = _sse_delta(line)
                    if delta is None or stop.is_set():
                        return
                    if delta:
                        yield delta
        except httpx.HTTPError as exc:
            raise ChatError(self._transport_message(exc)) from None

    def _checked(self, call: Callable[[], httpx.Response]) -> Any:
        try:
            response = call()
            if response.status_code < 400:
                return response.json()
        except httpx.HTTPError as exc:
            raise ChatError(self._transport_message(exc)) from None
        except ValueError:
            raise ChatError(f"{response.url} did not answer JSON; is it an OpenAI API root (.../v1)?") from None
        raise ChatError(_status_message(response))

    def _transport_message(self, exc: httpx.HTTPError) -> str:
        logger.debug("request to %s failed", self.url, exc_info=True)
        if isinstance(exc, httpx.ConnectError):
            return f"cannot reach {self.url} ({exc}); is `flashllm serve` running there?"
        if isinstance(exc, httpx.TimeoutException):
            return f"{self.url} did not answer in time ({type(exc).__name__}); the server may be overloaded"
        return f"the request to {self.url} failed: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.client.close()


def normalize_api_url(url: str) -> str:
    """The API root without a trailing slash; a bare "http://host:port" gets "/v1" added."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ChatError(f"--url must look like http://127.0.0.1:8000/v1, got {url!r}")
    return str(parsed).rstrip("/") + ("/v1" if parsed.path in ("", "/") else "")


def _status_message(response: httpx.Response) -> str:
    """One line from an error response, preferring the OpenAI `{"error": {"message", "code"}}` body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    error = error if isinstance(error, dict) else {"message": str(error or "")}
    detail = error.get("message") or response.text.strip()[:300] or response.reason_phrase
    hints = {401: " (check --api-key)"}
    hint = _CLEAR_HINT if error.get("code") == "context_length_exceeded" else hints.get(response.status_code, "")
    return f"the server answered {response.status_code}: {detail}{hint}"


def _sse_delta(line: str) -> str | None:
    """The text of one SSE line: "" for non-content lines, None at `data: [DONE]`."""
    if not line.startswith("data:"):
        return ""  # blank separators, comments and other fields
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return None
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise ChatError(f"the server streamed a line that is not JSON: {payload[:80]!r}") from None
    if isinstance(chunk, dict) and chunk.get("error"):
        error = chunk["error"]
        raise ChatError(f"the server stopped the reply: {error.get('message') if isinstance(error, dict) else error}")
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return ""
    return (choices[0].get("delta") or {}).get("content") or ""
