"""serving/reasoning.py: where a reply's reasoning ends and its content begins, whole and in any pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.serving.reasoning import REASONING_PARSERS, ReasoningSplitter, reasoning_splitter, split_reasoning


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("qwen3", "<think>\nweigh it</think>\n\nBlue.", ("\nweigh it", "Blue.")),
    ("qwen3", "Blue.", (None, "Blue.")),  # thinking off: no think block at all
    ("qwen3", "<think>cut off while thin", ("cut off while thin", "")),
    ("qwen3", "Blue.</think>", (None, "Blue.</think>")),  # a reply not opening the block is all content
    ("qwen3", "<thi", (None, "<thi")),  # a tag that never finished is text
    ("qwen3", "<think></think>", ("", "")),
    ("deepseek_r1", "weigh it</think>\n\nBlue.", ("weigh it", "Blue.")),  # the template opened the block
    ("deepseek_r1", "<think>weigh it</think>Blue.", ("weigh it", "Blue.")),
    ("deepseek_r1", "still weighing", ("still weighing", "")),
    ("deepseek_r1", "a</think>\n\nb</think>c", ("a", "b</think>c")),  # only the first end tag ends reasoning
    ("deepseek_r1", "a</think>\n\n\n", ("a", "")),
])
def test_whole_replies(parser: str, text: str, expected: tuple) -> None:
    assert split_reasoning(parser, text) == expected


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("r1")


# think tags and harmony's markers (openai_gptoss), whole and cut, beside text
PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", "\n\n", "a", "b c", "<th",
                                   "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "analysis", "final", "<|",
                                   "to=functions.f", "<|call|>"]),
                  max_size=12)


@settings(max_examples=400, deadline=None)
@given(parser=st.sampled_from(REASONING_PARSERS), parts=PIECES, data=st.data())
def test_any_cut_of_a_reply_streams_the_whole_reply(parser: str, parts: list[str], data: st.DataObject) -> None:
    """A stream's reasoning and content pieces, joined, are the whole reply's, however the text is cut."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    splitter = reasoning_splitter(parser)
    pieces = []
    for lo, hi in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += splitter.feed(text[lo:hi])
    pieces += splitter.flush()
    reasoning, content = split_reasoning(parser, text)
    assert "".join(t for kind, t in pieces if kind == "content") == content
    assert "".join(t for kind, t in pieces if kind == "reasoning") == (reasoning or "")
    assert all(t for _, t in pieces)  # no empty deltas
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning never follows content
