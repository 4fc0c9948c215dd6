"""`serve --reasoning-parser openai_gptoss`: gpt-oss's harmony replies answered as `reasoning_content` beside
`content`, as vLLM's parser of that name answers them.

A harmony reply (its prompt ends with `<|start|>assistant`) is a run of messages, each
`<|channel|>NAME[ to=RECIPIENT][<|constrain|>TYPE]<|message|>BODY` closed by `<|end|>`, `<|return|>` or `<|call|>`,
a later one opened again by `<|start|>assistant`. The bodies of `analysis` messages are the reasoning, the bodies
of every other channel's (`final`, `commentary`) the content; the markers are special tokens, so requests under
this parser keep them in the text (skip_special_tokens false) and the splitter takes them out. Text before any
marker (a reply that is not harmony) is content. A message to a function tool (`to=functions.NAME` in its header,
its body the arguments' JSON) becomes a Hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block in
the content, which the default `--tool-call-parser hermes` reads into tool_calls, whole and streamed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from flashllm.serving.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

PARSER = "openai_gptoss"
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CLOSING = frozenset({"<|end|>", "<|return|>", "<|call|>"})
# a message to a function tool: `to=functions.NAME` in its role or channel header
_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_-]{1,64})")


def split_harmony(text: str) -> tuple[str, str, bool]:
    """(reasoning, content, whether an analysis message began) of a whole harmony reply (module docstring)."""
    reasoning: list[str] = []
    content: list[str] = []
    state, channel, thought, call = "plain", "", False, False  # plain (no marker yet) | role | header | body | ...
    role: list[str] = []
    header: list[str] = []
    pos = 0
    for match in [*_MARKER.finditer(text), None]:
        piece = text[pos:match.start()] if match else text[pos:]
        if state == "plain" or (state == "body" and channel != "analysis"):
            content.append(piece)
        elif state == "body":
            reasoning.append(piece)
        elif state in ("role", "header"):
            (role if state == "role" else header).append(piece)
        if match is None:
            break
        marker, pos = match.group(), match.end()
        if marker == "<|start|>":
            state, role, header = "role", [], []
        elif marker == "<|channel|>":
            state, header = "header", []
        elif marker == "<|message|>":
            words = "".join(header).split() if state in ("header", "constraint") else []
            channel = words[0] if words else channel
            thought = thought or channel == "analysis"
            recipient = _RECIPIENT.search("".join(role) + " " + "".join(header))
            call = recipient is not None and channel != "analysis"
            if call:  # as a Hermes block, which the tool-call parser reads from the content
                content.append(f'{TOOL_CALL_OPEN}{{"name": {json.dumps(recipient[1])}, "arguments": ')
            state = "body"
        elif marker in _CLOSING:
            if call and state == "body":
                content.append(f"}}{TOOL_CALL_CLOSE}")
            state, call, role, header = "between", False, [], []
        elif marker == "<|constrain|>" and state == "header":
            state = "constraint"  # the constraint's type until <|message|>: neither channel nor body
    return "".join(reasoning), "".join(content), thought


def _partial_marker(text: str) -> int:
    """The length of the longest end of `text` that could still grow into a marker."""
    start = text.rfind("<")
    if start < 0 or "|>" in text[start:]:
        return 0
    tail = text[start:]
    return len(tail) if any(m.startswith(tail) for m in MARKERS) else 0


@dataclass
class HarmonySplitter:
    """ReasoningSplitter's interface over harmony replies: each call returns the (kind, text) pieces the reply
    places so far, kind "reasoning" or "content"; a tail that may be a marker's start is held back."""

    parser: str = PARSER
    thought: bool = False
    _text: str = ""
    _sent: tuple[int, int] = (0, 0)  # reasoning and content characters already returned
    _out: list[tuple[str, str]] = field(default_factory=list)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._text += text
        return self._place(self._text[:len(self._text) - _partial_marker(self._text)])

    def flush(self) -> list[tuple[str, str]]:
        """What is still held, placed as the reply ended."""
        return self._place(self._text)

    def take(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) this piece of the reply places, and with `finished` all that is still held."""
        pieces = (self.feed(text) if text else []) + (self.flush() if finished else [])
        return ("".join(t for kind, t in pieces if kind == "reasoning"),
                "".join(t for kind, t in pieces if kind == "content"))

    def _place(self, text: str) -> list[tuple[str, str]]:
        reasoning, content, thought = split_harmony(text)
        self.thought = self.thought or thought
        sent_reasoning, sent_content = self._sent
        out = [(kind, new[sent:]) for kind, new, sent in (("reasoning", reasoning, sent_reasoning),
                                                           ("content", content, sent_content)) if len(new) > sent]
        self._sent = (max(sent_reasoning, len(reasoning)), max(sent_content, len(content)))
        return out
