"""Hermes/Qwen-style `<tool_call>` blocks in generated text, parsed into OpenAI `tool_calls`."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOL_CALL_CHARS = 64 * 1024  # a block (tags included) longer than this is plain text
MAX_TOOL_CALLS = 64  # calls per message; later blocks stay text
MAX_TOOLS = 128

_NON_SPACE = re.compile(r"\S")
_OUTSIDE_STRING = re.compile(r'["<]')
_INSIDE_STRING = re.compile(r'[\\"]')
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; `arguments` is a JSON object serialized as a string."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls[i]` object: {"id", "type": "function", "function": {"name", "arguments"}}."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedToolCalls:
    """A finished message split into its text outside valid blocks (stripped, None if empty) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class StreamEvent:
    """Either text to forward now (`content`) or one complete call (`index`, `tool_call`); never both."""

    content: str | None = None
    index: int | None = None
    tool_call: ToolCall | None = None


class ContentTrimmer:
    """A reply's content as events, whitespace dropped at both ends: leading space before any text, and
    trailing space held until more text follows (so the events of any split of a text join to its strip())."""

    def __init__(self) -> None:
        self._started = False  # whether non-space content has been emitted
        self._held_space = ""

    def emit(self, text: str, events: list[StreamEvent]) -> None:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if body:
            events.append(StreamEvent(content=self._held_space + body))
            self._held_space = text[len(body):]
        else:
            self._held_space += text


class _BlockScanner:
    """Finds the end of a block that starts at offset 0 of a growing buffer, resuming where it stopped.

    A block whose body starts with `{` ends at the first closing tag outside a JSON string, so that
    `</tool_call>` inside an argument does not cut it; any other body ends at the first closing tag.
    """

    def __init__(self) -> None:
        self.pos = len(TOOL_CALL_OPEN)
        self.json_body: bool | None = None
        self.in_string = False

    def end(self, buf: str, limit: int) -> int | None:
        """Offset just past the closing tag if it lies within buf[:limit], else None (more text needed)."""
        if self.json_body is None:
            first = _NON_SPACE.search(buf, self.pos, limit)
            if first is None:
                self.pos = max(self.pos, limit)
                return None
            self.pos = first.start()
            self.json_body = buf[self.pos] == "{"
        return self._end_json(buf, limit) if self.json_body else self._end_plain(buf, limit)

    def _end_plain(self, buf: str, limit: int) -> int | None:
        at = buf.find(TOOL_CALL_CLOSE, self.pos, limit)
        if at >= 0:
            return at + len(TOOL_CALL_CLOSE)
        self.pos = max(self.pos, limit - len(TOOL_CALL_CLOSE) + 1)
        return None

    def _end_json(self, buf: str, limit: int) -> int | None:
        while True:
            found = (_INSIDE_STRING if self.in_string else _OUTSIDE_STRING).search(buf, self.pos, limit)
            if found is None:
                self.pos = limit
                return None
            char, at = found.group(), found.start()
            if char == "\\":
                if at + 1 >= limit:  # the escaped character has not arrived
                    self.pos = at
                    return None
                self.pos = at + 2
            elif char == '"':
                self.in_string = not self.in_string
                self.pos = at + 1
            elif buf.startswith(TOOL_CALL_CLOSE, at, limit):
                return at + len(TOOL_CALL_CLOSE)
            elif limit - at < len(TOOL_CALL_CLOSE) and TOOL_CALL_CLOSE.startswith(buf[at:limit]):
                self.pos = at
                return None
            else:
                self.pos = at + 1


class ToolCallStreamParser:
    """Splits streamed text into content to forward and tool calls, one delta at a time.

    Text that could still become `<tool_call>` is held back until it cannot; a call is emitted when
    its closing tag arrives. Whitespace at either end of the content is dropped (trailing whitespace is
    held until more content follows), so the content events of any split of a text concatenate to
    `parse_tool_calls(text).content or ""`.
    """

    def __init__(self, tool_names: Collection[str] | None = None, *, max_block_chars: int = MAX_TOOL_CALL_CHARS,
                 max_tool_calls: int = MAX_TOOL_CALLS) -> None:
        if max_block_chars < len(TOOL_CALL_OPEN) + len(TOOL_CALL_CLOSE):
            raise ValueError(f"max_block_chars={max_block_chars} cannot hold even an empty block; "
                             f"use at least {len(TOOL_CALL_OPEN) + len(TOOL_CALL_CLOSE)}")
        self._tool_names = None if tool_names is None else frozenset(tool_names)
        self._max_block_chars = max_block_chars
        self._max_tool_calls = max_tool_calls
        self._buf = ""
        self._scanner: _BlockScanner | None = None  # set while the buffer starts with an open tag
        self._num_calls = 0
        self._content = ContentTrimmer()
        self._flushed = False

    def feed(self, delta: str) -> list[StreamEvent]:
        """Take the next piece of generated text; return what can be decided now."""
        if self._flushed:
            raise RuntimeError("ToolCallStreamParser.feed() after flush(); create a parser per message")
        self._buf += delta
        events: list[StreamEvent] = []
        while self._step(events):
            pass
        return events

    def flush(self) -> list[StreamEvent]:
        """End of generation: whatever is held (a partial tag, an unterminated block) is content."""
        events: list[StreamEvent] = []
        if not self._flushed:
            self._emit_text(self._buf, events)
            self._buf, self._scanner, self._flushed = "", None, True
        return events

    def _step(self, events: list[StreamEvent]) -> bool:
        """Consume what can be decided at the head of the buffer; False when more text is needed."""
        if self._scanner is None:
            at = self._buf.find(TOOL_CALL_OPEN)
            if at < 0:
                cut = len(self._buf) - _partial_open_len(self._buf)
                self._emit_text(self._buf[:cut], events)
                self._buf = self._buf[cut:]
                return False
            self._emit_text(self._buf[:at], events)
            self._buf, self._scanner = self._buf[at:], _BlockScanner()
            return True
        end = self._scanner.end(self._buf, min(len(self._buf), self._max_block_chars))
        if end is not None:
            self._finish_block(self._buf[:end], events)
        elif len(self._buf) >= self._max_block_chars:
            end = self._max_block_chars  # too long to be a call: this much of it is plain text
            self._emit_text(self._buf[:end], events)
        else:
            return False
        self._buf, self._scanner = self._buf[end:], None
        return True

    def _finish_block(self, block: str, events: list[StreamEvent]) -> None:
        parsed = None
        if self._num_calls < self._max_tool_calls:
            parsed = _parse_call(block[len(TOOL_CALL_OPEN):-len(TOOL_CALL_CLOSE)], self._tool_names)
        if parsed is None:
            self._emit_text(block, events)
            return
        call = ToolCall(id=f"call_{secrets.token_hex(12)}", name=parsed[0], arguments=parsed[1])
        events.append(StreamEvent(index=self._num_calls, tool_call=call))
        self._num_calls += 1

    def _emit_text(self, text: str, events: list[StreamEvent]) -> None:
        self._content.emit(text, events)


def _partial_open_len(buf: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of the open tag."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(buf)), 0, -1):
        if buf.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _parse_call(body: str, tool_names: frozenset[str] | None) -> tuple[str, str] | None:
    """(name, arguments as a JSON object string) from a block body, or None if it is not a valid call."""
    try:
        # strict=False: models often put raw newlines inside strings; arguments are re-serialized anyway
        call = json.loads(body, strict=False, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    arguments = call_arguments(call.get("name"), call.get("arguments", {}), tool_names)
    return None if arguments is None else (call["name"], arguments)


def call_arguments(name: object, arguments: object, tool_names: frozenset[str] | None) -> str | None:
    """A call's arguments as a JSON object string, or None unless `name` is a non-empty string (one of
    `tool_names` when given) and `arguments` an object or a string holding a JSON object."""
    if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
        return None
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        if isinstance(arguments, str) and isinstance(json.loads(arguments, parse_constant=_reject_constant), dict):
            return arguments
    except (ValueError, RecursionError):
        pass
    return None


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None, *,
                     max_block_chars: int = MAX_TOOL_CALL_CHARS, max_tool_calls: int = MAX_TOOL_CALLS
                     ) -> ParsedToolCalls:
    """Split a finished message into content and tool calls.

    A block that is malformed (bad JSON, name missing or not a non-empty string, arguments not an
    object or a string holding a JSON object, a name outside `tool_names` when given, unterminated,
    longer than `max_block_chars`, or past `max_tool_calls`) stays in the content as text.
    """
    parser = ToolCallStreamParser(tool_names, max_block_chars=max_block_chars, max_tool_calls=max_tool_calls)
    events = parser.feed(text) + parser.flush()
    content = "".join(e.content for e in events if e.content is not None)
    return ParsedToolCalls(content or None, [e.tool_call for e in events if e.tool_call is not None])


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_tool(index: int, tool: object) -> str:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping):
        raise ValueError(f"{where} must be an object {{'type': 'function', 'function': {{...}}}}; got {_show(tool)}")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function' (the only tool type served); got {_show(tool.get('type'))}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function must be an object with a 'name'; got {_show(function)}")
    name = function.get("name")
    if not isinstance(name, str) or _TOOL_NAME.fullmatch(name) is None:
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; got {_show(name)}")
    # null is accepted as "not given": some clients serialize unset optional fields that way
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ValueError(f"{where}.function.description must be a string; got {_show(function['description'])}")
    if function.get("parameters") is not None and not isinstance(function["parameters"], Mapping):
        raise ValueError(f"{where}.function.parameters must be a JSON Schema object; got {_show(function['parameters'])}")
    return name


def validate_tools(tools: object) -> list[str]:
    """Check an OpenAI `tools` list (None means no tools); return the function names in order.

    Raises ValueError naming the index and field that is wrong.
    """
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}; got {_show(tools)}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are accepted, send fewer")
    names: list[str] = []
    for index, tool in enumerate(tools):
        name = _check_tool(index, tool)
        if name in names:
            raise ValueError(f"tools[{index}].function.name {name!r} repeats tools[{names.index(name)}]; "
                             "give each tool a unique name")
        names.append(name)
    return names


def check_tool_choice(tools: object, tool_choice: object) -> str | None:
    """Validate `tools` and `tool_choice`; return the mode or the forced function's name.

    Returns "none", "auto" or "required" for those modes (absent means "auto" with tools), the name
    for {"type": "function", "function": {"name": X}}, and None when neither is given. A tool named
    like a mode is indistinguishable from it here: look at `tool_choice` itself if that matters.
    """
    names = validate_tools(tools)
    if tool_choice is None:
        return "auto" if names else None
    if isinstance(tool_choice, str) and tool_choice in _MODES:
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one entry in tools; add tools or use 'auto'")
        return tool_choice
    if not isinstance(tool_choice, Mapping):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}; got {_show(tool_choice)}")
    if tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice.type must be 'function'; got {_show(tool_choice.get('type'))}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice.function.name must be a string naming one of tools; got {_show(function)}")
    if name not in names:
        offered = ", ".join(names) or "no tools were given"
        raise ValueError(f"tool_choice.function.name {name!r} is not in tools ({offered}); name one of them")
    return name
