"""Incremental detokenization and stop strings: streamed text that equals the final text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"

# Window policy: decode from a start token that trails the stream; once the window holds more
# than _MAX_WINDOW tokens and nothing is pending, restart it _CONTEXT_TOKENS back. The context
# lets decoders that look at neighbours (SentencePiece's leading-space rule) see one.
_CONTEXT_TOKENS = 4
_MAX_WINDOW = 32


class Decoder(Protocol):
    """The part of a tokenizer the detokenizer needs (transformers fast tokenizers and
    `tokenizers.Tokenizer` both provide it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, never emitting broken UTF-8.

    The concatenation of all deltas (plus `flush()`) equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)`: output is decoded on its own,
    like transformers' pipelines, so the first token's leading-space rule matches `decode`.
    `prompt_token_ids` is kept for callers that want it (e.g. echo); it does not affect text.

    Each `add` decodes a window of at most ~_MAX_WINDOW + new tokens, so the cost per token is
    constant, and diffs it against the part of that window already emitted. Text ending in
    U+FFFD may be a multi-byte character split across tokens: that tail is held back until a
    later token completes it or ends the run, or until `flush()`.

    Limits: decoders that rewrite earlier text when later tokens arrive (cleanup of spaces
    before punctuation, byte-fallback runs that turn invalid as a whole) cannot be streamed
    exactly; valid UTF-8 output of byte-level BPE and SentencePiece byte-fallback is. A long
    run of invalid bytes is held back (and the window grows) until something valid follows.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._window_start = 0   # first token of the decode window
        self._emitted = 0        # characters of the window's text already emitted

    def _decode_window(self) -> str:
        return self.tokenizer.decode(self.output_token_ids[self._window_start:],
                                     skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new output token ids; return the text they complete (possibly "")."""
        self.output_token_ids.extend(token_ids)
        text = self._decode_window()
        # A trailing U+FFFD may be a character split across tokens: hold the whole run back
        # (byte-fallback decoders show one per byte of an incomplete character).
        stable = len(text.rstrip(REPLACEMENT_CHAR))
        delta = text[self._emitted:stable] if stable > self._emitted else ""
        # max(): a byte-fallback run can decode shorter while a character is incomplete.
        self._emitted = max(self._emitted, stable)
        self.output_text += delta
        if stable == len(text) and len(self.output_token_ids) - self._window_start > _MAX_WINDOW:
            self._restart_window(text)
        return delta

    def _restart_window(self, text: str) -> None:
        """Move the window start forward to a token boundary that is also a character boundary.

        A start inside a multi-byte character would decode as U+FFFD (or, for byte-fallback
        runs, poison the whole run), so a candidate is taken only if its text is a clean
        suffix of the current window's text.
        """
        first = self._window_start + 1
        for start in range(len(self.output_token_ids) - _CONTEXT_TOKENS, first - 1, -1):
            candidate = self.tokenizer.decode(self.output_token_ids[start:],
                                              skip_special_tokens=self.skip_special_tokens)
            if text.endswith(candidate) and not candidate.startswith(REPLACEMENT_CHAR):
                self._window_start = start
                self._emitted = len(candidate)
                return
            if len(self.output_token_ids) - start > 2 * _CONTEXT_TOKENS:
                return  # no clean boundary nearby (e.g. invalid bytes); try again next time

    def flush(self) -> str:
        """Release anything held back (an incomplete character at the end becomes U+FFFD).

        Call once when the sequence finishes, so the text equals the full decode.
        """
        text = self._decode_window()
        delta = text[self._emitted:]
        self._emitted = len(text)
        self.output_text += delta
        return delta


class StopResult(NamedTuple):
    """What a StopChecker decided about the text seen so far."""

    finished: bool
    text: str               # text to emit now
    stop: str | None        # the stop string that ended the output, if any


class StopChecker:
    """Cuts generated text at the first stop string, even when it spans several deltas.

    "First" is the occurrence that ends earliest in the text (ties: the one starting earlier,
    i.e. the longer). That is the occurrence a stream meets first, so the emitted text is the
    same however the text is split into deltas. Text that may be the start of a stop string is
    held back until disambiguated, so a stream never shows part of a stop string; with
    `include_stop_str_in_output` the matched stop string is emitted at the end.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty; drop the empty string from `stop`")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.finished = False
        self._held = ""

    def feed(self, delta: str) -> StopResult:
        """Consume new text; return what may be shown now and whether a stop string hit."""
        if self.finished:
            raise RuntimeError("StopChecker already finished; create a new one per sequence")
        buf = self._held + delta
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else start
            self.finished = True
            self._held = ""
            return StopResult(True, buf[:end], stop)
        hold = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return StopResult(False, buf[:len(buf) - hold], None)

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason (EOS, length)."""
        text, self._held = self._held, ""
        return text

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = buf.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            first = max(0, len(buf) - len(stop) + 1)
            i = buf.find(stop[0], first)
            while i >= 0:
                if stop.startswith(buf[i:]):
                    longest = max(longest, len(buf) - i)
                    break
                i = buf.find(stop[0], i + 1)
        return longest
