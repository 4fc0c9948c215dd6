"""`serve --reasoning-parser`: a thinking model's `<think>...</think>` answered as `reasoning_content` beside
`content`, as vLLM's and llama.cpp's servers answer it (gpt-oss's harmony channels: serving/harmony.py).

Two rules, by the parsers' vLLM names:

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3's thinking-only models, whose templates open the
  think block in the prompt): the reply is reasoning up to `</think>` (a leading `<think>` dropped), content
  after it; a reply that never closes the block is all reasoning (it ended while thinking).
- `qwen3` (Qwen3's hybrid models, whose template leaves thinking on or off): a reply that starts with
  `<think>` is reasoning up to `</think>` or its end, then content; any other reply is all content (thinking
  was off, e.g. `chat_template_kwargs: {"enable_thinking": false}`).

The newlines the models write after `</think>` are not part of the content. One incremental splitter serves
whole replies and streams alike, so a streamed reply's pieces join to the whole reply's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashllm.sampling_params import REASONING_PARSERS as THINK_PARSERS
from flashllm.sampling_params import THINK_END, THINK_START
from flashllm.serving import harmony
from flashllm.serving.harmony import HarmonySplitter

# --reasoning-parser's choices: the think-block rules, and gpt-oss's harmony channels (serving/harmony.py)
REASONING_PARSERS = (*THINK_PARSERS, harmony.PARSER)


@dataclass
class ReasoningSplitter:
    """Feeds a reply's text in pieces; each call returns the (kind, text) pieces it can already place,
    kind "reasoning" or "content". A piece that could still be the start of a tag is held back."""

    parser: str
    thought: bool = False  # whether the reply had a reasoning part (possibly empty)
    _state: str = "start"  # start | reasoning | after_end | content
    _held: str = ""
    _out: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parser not in THINK_PARSERS:
            raise ValueError(f"reasoning parser {self.parser!r} is not one of: {', '.join(THINK_PARSERS)}")

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        self._out = []
        while self._held and self._step():
            pass
        return self._out

    def flush(self) -> list[tuple[str, str]]:
        """What is still held, placed as the reply ended (an unfinished tag is text of the current kind)."""
        self._out = []
        if self._state == "start":
            self._enter("reasoning" if self.parser == "deepseek_r1" else "content")
        if self._held and self._state != "after_end":
            self._emit("reasoning" if self._state == "reasoning" else "content", self._held)
        self._held = ""
        return self._out

    def take(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) this piece of the reply places, and with `finished` all that is still held."""
        pieces = (self.feed(text) if text else []) + (self.flush() if finished else [])
        return ("".join(t for kind, t in pieces if kind == "reasoning"),
                "".join(t for kind, t in pieces if kind == "content"))

    def _enter(self, state: str) -> None:
        self._state = state
        self.thought = self.thought or state == "reasoning"

    def _emit(self, kind: str, text: str) -> None:
        if text:
            self._out.append((kind, text))

    def _step(self) -> bool:
        """Place what the held text decides; False when the rest must wait for more text."""
        held = self._held
        if self._state == "start":
            if THINK_START.startswith(held):
                return False  # "<thi": a tag or not, the next piece says
            if held.startswith(THINK_START):
                self._held = held[len(THINK_START):]
                self._enter("reasoning")
            else:
                self._enter("reasoning" if self.parser == "deepseek_r1" else "content")
            return True
        if self._state == "reasoning":
            end = held.find(THINK_END)
            if end >= 0:
                self._emit("reasoning", held[:end])
                self._held, self._state = held[end + len(THINK_END):], "after_end"
                return True
            keep = _partial_tag(held, THINK_END)
            self._emit("reasoning", held[:len(held) - keep])
            self._held = held[len(held) - keep:]
            return False
        if self._state == "after_end":
            rest = held.lstrip("\n")
            self._held = rest
            if rest:
                self._state = "content"
            return bool(rest)
        self._emit("content", held)
        self._held = ""
        return False


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text that may be a split tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def reasoning_splitter(parser: str) -> ReasoningSplitter | HarmonySplitter:
    """The incremental splitter of a --reasoning-parser: think blocks, or gpt-oss's harmony messages."""
    return HarmonySplitter() if parser == harmony.PARSER else ReasoningSplitter(parser)


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    splitter = reasoning_splitter(parser)
    reasoning, content = splitter.take(text, finished=True)
    return (reasoning if splitter.thought else None), content
