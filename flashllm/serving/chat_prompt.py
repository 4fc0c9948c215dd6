"""Chat prompts whose message contents stay text: special-token spellings in content never become control tokens."""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

from flashllm.models.tokenizer import ChatTemplate, ChatTemplateError

ALLOW_FLAG = "--allow-special-tokens-in-content"


def special_token_texts(tokenizer: Any) -> list[str]:
    """The strings `tokenizer` turns into special tokens wherever they are spelt, longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(added.content)
    return sorted(filter(None, texts), key=len, reverse=True)


def encode_as_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` with any special-token spelling in it encoded as ordinary characters.

    Raises ChatTemplateError when the tokenizer cannot do that (it has no `split_special_tokens`).
    """
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:
        raise ChatTemplateError(f"this model's tokenizer ({type(tokenizer).__name__}) cannot encode special-token "
                                f"text as plain text; remove it from the message content, or start the server "
                                f"with {ALLOW_FLAG} if every caller is trusted") from None


def chat_prompt_ids(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                    allow_special_tokens_in_content: bool = False) -> list[int]:
    """The prompt token ids of a conversation: the template's own text with special tokens, contents as text.

    Without any special-token spelling in the contents this is the rendered prompt encoded whole
    (the usual tokens). Otherwise the template is rendered a second time with a random marker in
    place of each content; the markers split the prompt into the template's text (encoded with
    special tokens) and the contents (encoded as plain text), aligned against the real rendering
    by exact lengths, so a content cannot shift where the template's text begins. A template that
    rewrites contents beyond trimming whitespace cannot be aligned: that is a ChatTemplateError
    (400), never a silent fallback. `allow_special_tokens_in_content` restores parsing them.
    """
    text = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
    specials = special_token_texts(tokenizer)
    if allow_special_tokens_in_content or not any(s in c for c in contents if c for s in specials):
        return list(tokenizer.encode(text, add_special_tokens=False))
    nonce = secrets.token_hex(8)
    masked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if contents[i] is not None else m
              for i, m in enumerate(messages)]
    skeleton = template.render(masked, tools=tools, add_generation_prompt=add_generation_prompt)
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)  # literal, index, literal, ..., literal
    ids: list[int] = []
    pos = 0
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            if not text.startswith(piece, pos):
                _unaligned(template)
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
            pos += len(piece)
            continue
        content = contents[int(piece)] or ""
        following = pieces[k + 1]
        rendered = _rendered_content(text, pos, content, following)
        if rendered is None:
            _unaligned(template)
        ids += encode_as_text(tokenizer, rendered) if rendered else []
        pos += len(rendered)
    if pos != len(text):
        _unaligned(template)
    return ids


def _rendered_content(text: str, pos: int, content: str, following: str) -> str | None:
    """The form of `content` the template wrote at `pos` (itself or with whitespace trimmed), or None."""
    candidates: Sequence[str] = dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip()))
    for candidate in candidates:
        end = pos + len(candidate)
        if text.startswith(candidate, pos) and text.startswith(following, end):
            return candidate
    return None


def _unaligned(template: ChatTemplate) -> None:
    raise ChatTemplateError(f"a message content spells a special token and chat template {template.name!r} "
                            f"rewrites contents, so it cannot be kept as plain text; remove the special token "
                            f"from the content, or start the server with {ALLOW_FLAG} if every caller is trusted")
