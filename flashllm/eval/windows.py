"""Sliding windows over a long token sequence: which tokens each window runs and which it scores."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    """Tokens [begin, end) run through the model; targets at positions [score_from, end) are scored.

    A target at position p is predicted by the logits at p - 1, with the tokens
    begin..p-1 as its context.
    """

    begin: int
    end: int
    score_from: int

    @property
    def num_scored(self) -> int:
        return self.end - self.score_from

    def logit_rows(self) -> range:
        """Rows of the window's logits (0 = its first token) that predict the scored targets."""
        return range(self.score_from - 1 - self.begin, self.end - 1 - self.begin)


def check_window(max_length: int, stride: int) -> None:
    """ValueError unless 2 <= max_length and 1 <= stride <= max_length."""
    if max_length < 2:
        raise ValueError(f"--max-length must be at least 2 (one context token and one target), got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"--stride must be in [1, --max-length={max_length}] (a longer stride skips tokens "
                         f"between windows), got {stride}")


def sliding_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The strided windows of the HF "perplexity of fixed-length models" method.

    Windows start every `stride` tokens and hold up to `max_length` tokens; each scores only the
    tokens no earlier window scored, and never its own first token (it has no context there).
    With stride < max_length every token but the text's first is scored exactly once, with at
    least max_length - stride tokens of context after the first window; with stride ==
    max_length (disjoint chunks) the first token of every chunk goes unscored, as in the guide.
    Stops at the window that reaches the end of the text.
    """
    check_window(max_length, stride)
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows
