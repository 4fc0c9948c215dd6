"""Lark items for the marker strings grammars wrap around a constraint (`</think>`, `[TOOL_CALLS]`)."""

from __future__ import annotations

import json
from typing import Any


def tag_grammar(tokenizer: Any, tag: str) -> str:
    """The Lark item matching `tag`: its added token (`<[id]>`) when the tokenizer has one, else its text.

    llguidance reads every added token as a special token, never as its text, so a marker the tokenizer
    holds as one token (Qwen3's `</think>`, Mistral's `[TOOL_CALLS]`) must be named by id to be allowed."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    token_id = added.get(tag)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(tag)
