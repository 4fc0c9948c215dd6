"""SSE framing: one event per payload, no raw characters that line splitters treat as breaks."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from flashllm.serving.openai_api import sse  # noqa: E402

TRICKY = "a\nb\r\nc\x85d\u2028e\u2029f\x0bg 中文 🙂"


def test_event_survives_every_line_splitter() -> None:
    frame = sse({"text": TRICKY}).decode()
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    body = frame[len("data: "):-2]
    assert body.splitlines() == [body]  # str.splitlines breaks on \x85, \u2028, \u2029, \x0b ...
    assert json.loads(body) == {"text": TRICKY}
    assert "中文" in body  # non-ASCII text is not escaped wholesale


def test_done_marker() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
