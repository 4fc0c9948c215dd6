"""Tokenizer loading, EOS ids, and a model directory's chat template (rendered by chat_template.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
from flashllm.models.chat_template import MAX_TEMPLATE_BYTES, ChatTemplate, ChatTemplateError
from flashllm.models.gguf.reader import is_gguf_path, open_gguf
from flashllm.models.hf_config import read_json_object
from flashllm.models.tokenizers import native_tokenizer_loader

MAX_CONFIG_BYTES = 32 << 20          # tokenizer_config.json (added-token tables can be large)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


# ---------------------------------------------------------------- loading


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, MAX_CONFIG_BYTES)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _check_tokenizer_class(config: dict[str, Any], path: Path) -> None:
    name = config.get("tokenizer_class")
    if name is None:
        return
    try:
        known = isinstance(name, str) and _NAME.fullmatch(name) is not None and any(
            getattr(transformers, n, None) is not None for n in (name, f"{name}Fast"))
    except ImportError:  # a transformers class whose optional backend is missing
        known = False
    if not known:
        raise ValueError(f"tokenizer_class {name!r} in {path / 'tokenizer_config.json'} is not part of transformers: "
                         "loading it would run code from the model directory (auto_map / trust_remote_code), which "
                         "flashllm never does. Convert it to tokenizer.json and set tokenizer_class to "
                         "\"PreTrainedTokenizerFast\".")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the fast (Rust-backed) tokenizer of a local model directory.

    Never downloads and never runs code from the directory. Without a `tokenizer_class` in
    tokenizer_config.json, `tokenizer.json` is wrapped directly, taking special tokens
    (bos/eos/unk/pad, additional) from tokenizer_config.json when present. A `tokenizer_class`
    that Hugging Face ships as remote code is built natively when flashllm.models.tokenizers has it.
    """
    root = Path(path)
    if is_gguf_path(root):  # the vocabulary a GGUF file carries (models/gguf/tokenizer.py)
        from flashllm.models.gguf.tokenizer import build_gguf_tokenizer

        return build_gguf_tokenizer(open_gguf(root))
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist; pass a local directory "
                                "holding tokenizer.json (flashllm never downloads)")
    config_path, file_path = root / "tokenizer_config.json", root / "tokenizer.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    native = native_tokenizer_loader(config.get("tokenizer_class"))
    if native is not None:  # a remote-code tokenizer flashllm builds itself from the directory's files
        return native(root, config)
    _check_tokenizer_class(config, root)
    if file_path.is_file() and config.get("tokenizer_class") is None:
        return _wrap_tokenizer_json(file_path, config)
    if not config_path.is_file():
        raise FileNotFoundError(f"{root} has neither tokenizer.json nor tokenizer_config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, ImportError) as exc:
        # transformers reads tokenizer_config.json's values without checking their types (a list where
        # a token belongs, a string where a table does): any of these is a bad file, not a crash; older
        # transformers 5.x releases fall back to a slow tokenizer for such a file and fail importing its
        # optional dependency (protobuf), so the ImportError is the same bad file
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ValueError(f"could not load the tokenizer in {root} ({detail}); check tokenizer_config.json "
                         "against the model's original") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer in {root} loaded as the slow {type(tokenizer).__name__}; flashllm needs a "
                         "fast tokenizer: add a tokenizer.json")
    return tokenizer


def _wrap_tokenizer_json(file_path: Path, config: dict[str, Any]) -> PreTrainedTokenizerFast:
    kwargs: dict[str, Any] = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, list):
        kwargs["additional_special_tokens"] = [t for t in map(_token_text, extra) if t]
    kwargs["clean_up_tokenization_spaces"] = bool(config.get("clean_up_tokenization_spaces", False))
    return PreTrainedTokenizerFast(tokenizer_file=str(file_path), **{k: v for k, v in kwargs.items() if v is not None})


# generation_config.json's `chat_format` (first-generation Qwen) -> (built-in template, its stop tokens)
CHAT_FORMATS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "chatml": ("qwen", ("<|im_end|>", "<|im_start|>")),
    "raw": (None, ()),
}


def eos_token_ids(tokenizer: Any, generation_config: dict[str, Any] | None) -> list[int]:
    """The tokenizer's EOS id, then generation_config's `eos_token_id` (int or list), then the stop
    tokens of its `chat_format` (CHAT_FORMATS), then the tokenizer's own `turn_end_tokens` (tokens a
    natively built tokenizer names as ending a turn, e.g. ChatGLM3's <|user|>), deduped."""
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    configured = (generation_config or {}).get("eos_token_id")
    candidates += configured if isinstance(configured, list) else [configured]
    chat_format = (generation_config or {}).get("chat_format")
    _, stop_tokens = CHAT_FORMATS.get(chat_format, (None, ())) if isinstance(chat_format, str) else (None, ())
    stop_tokens = (*stop_tokens, *getattr(tokenizer, "turn_end_tokens", ()))
    candidates += [_token_id(tokenizer, t) for t in stop_tokens]
    ids = [t for t in candidates if t is not None]
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"eos_token_id must be a non-negative integer or a list of them, got {token_id!r}")
    return list(dict.fromkeys(ids))


def _token_id(tokenizer: Any, token: str) -> int | None:
    """`token`'s id, or None when the vocabulary lacks it (convert_tokens_to_ids would give unk's)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token else None


# ---------------------------------------------------------------- a model directory's chat template


def _template_from_config(config: dict[str, Any], name: str | None, path: Path) -> str | None:
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value if name in (None, "default") else None
    if not isinstance(value, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                              and isinstance(t.get("template"), str) for t in value):
        raise ChatTemplateError(f"chat_template in {path} must be a string or a list of {{name, template}} objects")
    return {t["name"]: t["template"] for t in value}.get(name or "default")


def load_chat_template(path: str | Path, name: str | None = None) -> ChatTemplate | None:
    """The chat template of a model directory, or None when it has none.

    Looks at, in order: `chat_template.jinja` (or `additional_chat_templates/<name>.jinja`
    when `name` is given), `chat_template` in tokenizer_config.json (a string, or a list of
    {name, template} from which `name`, default "default", is taken), then the built-in
    template called `name` (without a name: the one the checkpoint's own files point to, see
    checkpoint_chat_format). Special tokens come from tokenizer_config.json.
    """
    root = Path(path)
    if name is not None and not _NAME.fullmatch(name):
        raise ChatTemplateError(f"chat template name {name!r} must be letters, digits, '_.-'")
    if is_gguf_path(root):
        return _gguf_chat_template(root, name)
    config_path = root / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    tokens = {k: _token_text(config.get(k)) or "" for k in ("bos_token", "eos_token")}
    file = (root / "chat_template.jinja" if name in (None, "default")
            else root / "additional_chat_templates" / f"{name}.jinja")
    if file.is_file() and file.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{file} is over the {MAX_TEMPLATE_BYTES}-byte template limit")
    source = file.read_text(encoding="utf-8") if file.is_file() else _template_from_config(config, name, config_path)
    if source is not None:
        return ChatTemplate(source, name=name or "default", **tokens)
    if name is None:  # a checkpoint whose prompt format lives in its remote code: pick the built-in one
        name = checkpoint_chat_format(root, config)
    if name is not None and name in BUILTIN_TEMPLATES:
        return ChatTemplate.builtin(name, **{k: v or None for k, v in tokens.items()})
    if name is not None:
        raise ChatTemplateError(f"{root} has no chat template named {name!r} and there is no built-in one; "
                                f"built-ins: {', '.join(BUILTIN_TEMPLATES)}")
    return None


def _gguf_chat_template(path: Path, name: str | None) -> ChatTemplate | None:
    """A GGUF file's `tokenizer.chat_template` (or `tokenizer.chat_template.<name>`), else the built-in `name`."""
    from flashllm.models.gguf.tokenizer import gguf_chat_template

    source, special = gguf_chat_template(open_gguf(path), name)
    if source is not None:
        return ChatTemplate(source, name=name or "default", **special)
    if name is not None and name not in BUILTIN_TEMPLATES:
        raise ChatTemplateError(f"{path.name} has no chat template named {name!r} and there is no built-in one; "
                                f"built-ins: {', '.join(BUILTIN_TEMPLATES)}")
    return None if name is None else ChatTemplate.builtin(name, **{k: v or None for k, v in special.items()})


def checkpoint_chat_format(root: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The built-in template a checkpoint without a template of its own was made for, or None.

    First-generation Qwen: generation_config.json's `chat_format` (CHAT_FORMATS). Baichuan-13B-Chat
    and Baichuan2-Chat: generation_config.json's `user_token_id` and `assistant_token_id` (the ids
    their build_chat_input writes before each turn) -> "baichuan-2". ChatGLM2 / ChatGLM3 (a
    ChatGLMTokenizer; ChatGLM3's later revisions ship a template, read before this): the
    generation named in config.json's `_name_or_path` or tokenizer_config.json's `name_or_path`,
    since their files are otherwise alike; a fine-tune naming neither gets no template (pass one).
    GLM-4-Chat (a ChatGLM4Tokenizer; its releases ship a template, read before this) -> "glm-4".
    """
    path = root / "generation_config.json"
    generation = _read_json(path) if path.is_file() else {}
    fmt = generation.get("chat_format")
    if isinstance(fmt, str) and fmt in CHAT_FORMATS:
        return CHAT_FORMATS[fmt][0]
    if all(_is_id(generation.get(k)) for k in ("user_token_id", "assistant_token_id")):
        return "baichuan-2"
    if tokenizer_config.get("tokenizer_class") == "ChatGLM4Tokenizer":
        return "glm-4"
    if tokenizer_config.get("tokenizer_class") == "ChatGLMTokenizer":
        config_path = root / "config.json"
        names = [(_read_json(config_path) if config_path.is_file() else {}).get("_name_or_path"),
                 tokenizer_config.get("name_or_path")]
        for name in (n.lower() for n in names if isinstance(n, str)):
            for generation_name in ("chatglm3", "chatglm2"):
                if generation_name in name:
                    return generation_name
    return None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
