"""`serve --tool-call-parser`: the ways models write tool calls, each read into OpenAI `tool_calls`.

- `hermes` (Qwen2.5/Qwen3, Hermes, and flashllm's default): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks anywhere in the reply (serving/tool_calls.py).
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with their templates' JSON tool calling): the reply *is* the call, a
  JSON object `{"name", "parameters"}` (or `"arguments"`), optionally after `<|python_tag|>`; several are
  separated by `;`.
- `mistral` (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct, Mistral-Nemo): `[TOOL_CALLS]` followed by a
  JSON array of `{"name", "arguments"}`; text before the marker is content.

- `glm45` (GLM-4.5 / 4.5-Air / 4.6): `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
  pairs and `</tool_call>`, one block per call; a value is the argument's text where the tool's schema says
  the argument is a string (or does not say), else the JSON it holds; text before the first block is content.

Llama's, Mistral's and GLM's calls run to the end of the reply, so a stream holds them until the reply ends and
then sends each call whole, as the Hermes parser sends each block whole. A reply whose calls do not parse
(bad JSON, unknown tool, too many calls) is all content.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Collection, Mapping
from typing import Any

from flashllm.serving.tool_calls import (
    MAX_TOOL_CALL_CHARS,
    MAX_TOOL_CALLS,
    ContentTrimmer,
    ParsedToolCalls,
    StreamEvent,
    ToolCall,
    ToolCallStreamParser,
    call_arguments,
)

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "glm45")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
GLM45_CALL, GLM45_END = "<tool_call>", "</tool_call>"
_GLM45_PAIR = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
# the special tokens a parser reads: a request with tools keeps them in the reply's text
READS_SPECIAL_TOKENS = frozenset({"llama3_json", "mistral", "glm45"})


class TrailingCallsParser:
    """Calls that run from a marker to the end of the reply: text before the marker streams as content (a
    partial marker held back), the rest is held and parsed when the reply ends.

    markers: what starts the calls; at_start: they count only at the reply's start (after whitespace);
    parse: the held text (from the marker on) -> [(name, arguments JSON)], or None when it is not calls.
    """

    def __init__(self, markers: tuple[str, ...], at_start: bool, parse: Callable[[str], list[tuple[str, str]] | None],
                 max_chars: int = MAX_TOOL_CALL_CHARS * MAX_TOOL_CALLS) -> None:
        self._markers, self._at_start, self._parse, self._max_chars = markers, at_start, parse, max_chars
        self._buf = ""
        self._holding = False
        self._content = ContentTrimmer()
        self._seen_text = False  # for at_start: whether non-space text came before any marker

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buf += delta
        events: list[StreamEvent] = []
        if not self._holding:
            self._scan(events)
        return events

    def flush(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        calls = self._parse(self._buf) if self._holding and len(self._buf) <= self._max_chars else None
        if calls is None:
            self._content.emit(self._buf, events)
        else:
            for index, (name, arguments) in enumerate(calls):
                events.append(StreamEvent(index=index, tool_call=ToolCall(f"call_{secrets.token_hex(12)}", name,
                                                                          arguments)))
        self._buf = ""
        return events

    def _scan(self, events: list[StreamEvent]) -> None:
        """Send the text that cannot start a marker; from a marker on, hold the reply."""
        text = self._buf
        if self._at_start:
            if self._seen_text:
                self._content.emit(text, events)
                self._buf = ""
                return
            body = text.lstrip()
            if any(body.startswith(m) for m in self._markers):
                self._holding = True
            elif body and not any(m.startswith(body) for m in self._markers):
                self._seen_text = True
                self._content.emit(text, events)
                self._buf = ""
            return
        found = [at for at in (text.find(m) for m in self._markers) if at >= 0]
        if found:
            self._content.emit(text[:min(found)], events)
            self._buf, self._holding = text[min(found):], True
            return
        keep = max((_partial_len(text, m) for m in self._markers), default=0)
        self._content.emit(text[:len(text) - keep], events)
        self._buf = text[len(text) - keep:]


def _partial_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _json_values(text: str) -> list[Any] | None:
    """The JSON values of `text`, one after another, separated by whitespace or `;` (None if any is not JSON)."""
    decoder = json.JSONDecoder(strict=False)
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        values.append(value)


def _calls(objects: list[Any] | None, argument_keys: tuple[str, ...], tool_names: frozenset[str] | None,
           max_calls: int) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call object, or None if any is not a call of a known tool."""
    if not objects or len(objects) > max_calls:
        return None
    calls = []
    for obj in objects:
        if not isinstance(obj, dict):
            return None
        key = next((k for k in argument_keys if k in obj), argument_keys[0])
        arguments = call_arguments(obj.get("name"), obj.get(key, {}), tool_names)
        if arguments is None:
            return None
        calls.append((obj["name"], arguments))
    return calls


def _llama3_parse(tool_names: frozenset[str] | None, max_calls: int) -> Callable[[str], list[tuple[str, str]] | None]:
    def parse(text: str) -> list[tuple[str, str]] | None:
        body = text.lstrip().removeprefix(PYTHON_TAG)
        return _calls(_json_values(body), ("parameters", "arguments"), tool_names, max_calls)
    return parse


def _mistral_parse(tool_names: frozenset[str] | None, max_calls: int) -> Callable[[str], list[tuple[str, str]] | None]:
    def parse(text: str) -> list[tuple[str, str]] | None:
        values = _json_values(text.removeprefix(MISTRAL_TOOL_CALLS))
        if not values or not all(isinstance(v, list) for v in values):
            return None
        return _calls([obj for value in values for obj in value], ("arguments",), tool_names, max_calls)
    return parse


def _glm45_parse(tools: Mapping[str, Any], tool_names: frozenset[str] | None,
                 max_calls: int) -> Callable[[str], list[tuple[str, str]] | None]:
    def parse(text: str) -> list[tuple[str, str]] | None:
        calls: list[tuple[str, str]] = []
        at = 0
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return calls or None
            block = _glm45_block(text, at)
            if block is None or len(calls) == max_calls:
                return None
            name, pairs, at = block
            schema = tools.get(name) if isinstance(tools.get(name), dict) else {}
            properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            arguments = call_arguments(name, {key: _glm45_value(value, properties.get(key)) for key, value in pairs},
                                       tool_names)
            if arguments is None:
                return None
            calls.append((name, arguments))
    return parse


def _glm45_block(text: str, at: int) -> tuple[str, list[tuple[str, str]], int] | None:
    """(name, [(key, value)], the index past it) of the `<tool_call>` block at `at`, or None if it is not one."""
    if not text.startswith(GLM45_CALL, at):
        return None
    end = text.find(GLM45_END, at)
    if end < 0:
        return None
    body, pairs = text[at + len(GLM45_CALL):end], []
    first = body.find(_GLM45_PAIR[0])
    name, rest = (body, "") if first < 0 else (body[:first], body[first:])
    while rest.strip():
        parts, pos = [], 0
        for tag in _GLM45_PAIR:  # each tag in order, with only whitespace between a closing and the next opening
            found = rest.find(tag, pos)
            if found < 0 or (tag in (_GLM45_PAIR[0], _GLM45_PAIR[2]) and rest[pos:found].strip()):
                return None
            parts.append(rest[pos:found])
            pos = found + len(tag)
        pairs.append((parts[1].strip(), parts[3]))
        rest = rest[pos:]
    return name.strip(), pairs, end + len(GLM45_END)


def _glm45_value(text: str, schema: Any) -> Any:
    """An argument's value: its text where the schema says string (or nothing), else the JSON it holds (its text
    when it holds none)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kind is None or "string" in kinds:
        return text
    try:
        return json.loads(text.strip(), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def stream_parser(parser: str, tool_names: Collection[str] | None = None,
                  max_tool_calls: int = MAX_TOOL_CALLS) -> ToolCallStreamParser | TrailingCallsParser:
    """A per-reply parser (feed(delta) / flush() -> StreamEvents) for the format `parser` names. tool_names: the
    tools' names, or a mapping of them to their parameters schemas (which glm45 reads its values by)."""
    names = None if tool_names is None else frozenset(tool_names)
    if parser == "hermes":
        return ToolCallStreamParser(names, max_tool_calls=max_tool_calls)
    if parser == "llama3_json":
        return TrailingCallsParser((PYTHON_TAG, "{"), True, _llama3_parse(names, max_tool_calls))
    if parser == "mistral":
        return TrailingCallsParser((MISTRAL_TOOL_CALLS,), False, _mistral_parse(names, max_tool_calls))
    if parser == "glm45":
        schemas = tool_names if isinstance(tool_names, Mapping) else {}
        return TrailingCallsParser((GLM45_CALL,), False, _glm45_parse(schemas, names, max_tool_calls))
    raise ValueError(f"tool call parser {parser!r} is not one of: {', '.join(TOOL_CALL_PARSERS)}")


def parse_reply(parser: str, text: str, tool_names: Collection[str] | None = None,
                max_tool_calls: int = MAX_TOOL_CALLS) -> ParsedToolCalls:
    """A finished reply split into content and tool calls by the format `parser` names."""
    reader = stream_parser(parser, tool_names, max_tool_calls)
    events = reader.feed(text) + reader.flush()
    content = "".join(e.content for e in events if e.content is not None)
    return ParsedToolCalls(content or None, [e.tool_call for e in events if e.tool_call is not None])
