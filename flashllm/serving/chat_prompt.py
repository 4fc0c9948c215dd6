"""Chat prompts whose message contents stay text: special-token spellings in content never become control tokens."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from flashllm.models.chat_template import ChatTemplate, ChatTemplateError, continued_end

ALLOW_FLAG = "--allow-special-tokens-in-content"


# Text longer than this many characters per token of context is not tokenized whole to learn that it is too
# long: a prefix of that length is, and holding more than the context (with BOUNDARY_TOKENS to spare for a
# word cut at its end) settles it. Tokenizing 1 MB of text whole takes ~0.6-1 s on a 2-core CPU.
SCAN_CHARS_PER_TOKEN = 16
BOUNDARY_TOKENS = 64


def tokens_past_context(tokenizer: Any, texts: Sequence[str], context: int) -> int | None:
    """A lower bound on the tokens of the longest of `texts` when a prefix of it already holds more than
    `context` tokens, else None (then encode it whole). Only long texts are looked at: a text of at most
    context x SCAN_CHARS_PER_TOKEN characters returns None without being tokenized."""
    cut = context * SCAN_CHARS_PER_TOKEN
    found = None
    for text in texts:
        if len(text) > cut:
            held = len(tokenizer.encode(text[:cut], add_special_tokens=False)) - BOUNDARY_TOKENS
            if held > context and (found is None or held > found):
                found = held
    return found


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
                    allow_special_tokens_in_content: bool = False,
                    template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> list[int]:
    """The prompt token ids of a conversation: the template's own text with special tokens, callers' text as text.

    Callers' text is every string in `messages`, `tools` and `template_kwargs` (contents, names, tool calls,
    tool descriptions, extra template variables such as Qwen3's enable_thinking). Without a special-token spelling in any of them this is the rendered prompt
    encoded whole (the usual tokens). Otherwise the template is rendered a second time with a
    random marker in place of each such string; the markers split the prompt into the template's
    text (encoded with special tokens) and the callers' strings (encoded as plain text), aligned
    against the real rendering by exact lengths, so a string cannot shift where the template's
    text begins. A string may appear as given, with its whitespace trimmed or JSON-escaped (tojson);
    a template that rewrites it otherwise cannot be aligned: that is a ChatTemplateError (400),
    never a silent fallback. `allow_special_tokens_in_content` restores parsing them.
    `continue_final_message` ends the prompt just after the last message's content (continued_end), so
    the model goes on with that message instead of closing it.
    """
    extra = template_kwargs or {}
    text = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
    end = continued_end(text, messages) if continue_final_message else len(text)
    specials = special_token_texts(tokenizer)
    if allow_special_tokens_in_content or not specials:
        return list(tokenizer.encode(text[:end], add_special_tokens=False))
    nonce = secrets.token_hex(8)
    found: list[str] = []
    masked = _mask(messages, specials, nonce, found)
    masked_tools = _mask(tools, specials, nonce, found)
    masked_extra = _mask(extra, specials, nonce, found)
    if not found:
        return list(tokenizer.encode(text[:end], add_special_tokens=False))
    skeleton = template.render(masked, tools=masked_tools, add_generation_prompt=add_generation_prompt,
                               **masked_extra)
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)  # literal, index, literal, ..., literal
    ids: list[int] = []
    pos = 0
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            if not text.startswith(piece, pos):
                _unaligned(template)
            kept = piece[:end - pos]
            ids += tokenizer.encode(kept, add_special_tokens=False) if kept else []
        else:
            piece = _rendered_string(text, pos, found[int(piece)], pieces[k + 1])
            if piece is None:
                _unaligned(template)
            kept = piece[:end - pos]
            ids += encode_as_text(tokenizer, kept) if kept else []
        pos += len(piece)
        if pos >= end:  # the whole prompt, or where a continued last message stops
            break
    if pos < end:
        _unaligned(template)
    return ids


def _mask(value: Any, specials: list[str], nonce: str, found: list[str]) -> Any:
    """`value` with each string that spells a special token replaced by a marker (the strings go to `found`)."""
    if isinstance(value, str):
        if not any(s in value for s in specials):
            return value
        found.append(value)
        return f"\ue000{nonce}:{len(found) - 1}\ue001"
    if isinstance(value, list):
        return [_mask(v, specials, nonce, found) for v in value]
    if isinstance(value, dict):
        if any(isinstance(k, str) and any(s in k for s in specials) for k in value):
            raise ChatTemplateError(f"a key in the messages or tools spells a special token; remove it, or start "
                                    f"the server with {ALLOW_FLAG} if every caller is trusted")
        return {k: _mask(v, specials, nonce, found) for k, v in value.items()}
    return value


def _rendered_string(text: str, pos: int, value: str, following: str) -> str | None:
    """The form of `value` the template wrote at `pos` (as given, trimmed, or JSON-escaped), or None."""
    escaped = json.dumps(value, ensure_ascii=False)[1:-1]
    candidates: Sequence[str] = dict.fromkeys((value, value.strip(), value.lstrip(), value.rstrip(), escaped))
    for candidate in candidates:
        end = pos + len(candidate)
        if text.startswith(candidate, pos) and text.startswith(following, end):
            return candidate
    return None


def _unaligned(template: ChatTemplate) -> None:
    raise ChatTemplateError(f"a message content spells a special token and chat template {template.name!r} "
                            f"rewrites contents, so it cannot be kept as plain text; remove the special token "
                            f"from the content, or start the server with {ALLOW_FLAG} if every caller is trusted")
