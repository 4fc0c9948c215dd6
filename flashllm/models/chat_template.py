"""Chat templates rendered in a bounded jinja2 sandbox: ChatTemplate, render_chat, validate_messages."""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.visitor import NodeTransformer

from flashllm.models.builtin_templates import BUILTIN_TEMPLATES

MAX_TEMPLATE_BYTES = 64 << 10        # chat template source
MAX_RENDERED_CHARS = 1 << 20         # rendered prompt, and any string/list a template builds
MAX_MESSAGES = 1024
MAX_CONTENT_CHARS = 1 << 20          # all message contents together
MAX_TOOLS = 128
MAX_JSON_CHARS = 4 << 20             # messages + tools serialized, extra fields included
MAX_RENDER_STEPS = 1_000_000         # loop iterations + calls per render
MAX_RENDER_SECONDS = 2.0
MAX_ARG_INT = 100_000                # widths, counts, repeats passed to calls and filters
ROLES = ("system", "user", "assistant", "tool")


# ---------------------------------------------------------------- sandbox


class ChatTemplateError(ValueError):
    """The chat template or the messages could not be rendered (a client-side error)."""


class ChatTemplateSecurityError(ChatTemplateError, SecurityError):
    """The template tried something the sandbox forbids or exceeded a resource limit."""


@dataclass
class _Budget:
    steps_left: int
    deadline: float


_BUDGET: ContextVar[_Budget | None] = ContextVar("flashllm_chat_template_budget", default=None)
_WIDE_FORMAT = re.compile(r"[:%][-+ #0<>=^,_]*(\*|\d{6,})|\.\d{6,}")


def _refuse(what: str) -> None:
    raise ChatTemplateSecurityError(f"chat template {what}")


def _spend() -> None:
    """One loop iteration or call: charge the render's budget, check its deadline."""
    budget = _BUDGET.get()
    if budget is None:
        _refuse("rendered outside ChatTemplate.render")
    budget.steps_left -= 1
    if budget.steps_left < 0:
        _refuse(f"exceeded {MAX_RENDER_STEPS} loop iterations and calls")
    if time.monotonic() > budget.deadline:
        _refuse(f"ran longer than {MAX_RENDER_SECONDS} s")


def _weight(value: Any, seen: dict[int, int] | None = None) -> int:
    """Roughly the characters str(value) needs; a shared sub-list is walked once."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple, dict)):
        return 8
    seen = {} if seen is None else seen
    if id(value) not in seen:
        items = value.values() if isinstance(value, dict) else value
        seen[id(value)] = 2 + sum(_weight(v, seen) + 2 for v in items)
    return seen[id(value)]


def _check_size(value: Any) -> Any:
    """Size-check a value a template built or is about to print (also the `finalize` hook)."""
    if isinstance(value, (str, list, tuple, dict)) and _weight(value) > MAX_RENDERED_CHARS:
        _refuse(f"built a value past the {MAX_RENDERED_CHARS}-character limit")
    return value


def _check_args(args: list[Any], owner: Any, method: str) -> None:
    """Bound ints passed to calls/filters; pre-check str operations that multiply a size."""
    if any(isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARG_INT for a in args):
        _refuse(f"passes an integer over {MAX_ARG_INT} to {method!r}")
    text = owner if isinstance(owner, str) else ""
    if method in ("format", "format_map") and _WIDE_FORMAT.search(text):
        _refuse("uses a format width or precision over 5 digits")
    grow = 0
    if method == "join":  # str.join(seq) or the filter seq|join(sep)
        seq, sep = (args[0] if args else None, text) if isinstance(owner, str) else (owner, (args or [""])[0])
        if isinstance(seq, (list, tuple)):
            grow = _weight(seq) + len(sep if isinstance(sep, str) else "") * len(seq)
    elif method == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        grow = (text.count(args[0]) if args[0] else len(text) + 1) * max(0, len(args[1]) - len(args[0]))
    elif method in ("indent", "expandtabs") and args and isinstance(args[0], (int, str)):
        width = args[0] if isinstance(args[0], int) else len(args[0])
        grow = (text.count("\n") + text.count("\t") + 1) * max(0, width)
    if len(text) + grow > MAX_RENDERED_CHARS:
        _refuse(f"{method} would exceed the size limit")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `*`, `**` and `%` whose result would be huge, before computing it."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*" and not ints:
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and times > 0 and _weight(seq) * times > MAX_RENDERED_CHARS:
            _refuse("repeats a value past the size limit")
    bits = {"*": lambda: left.bit_length() + right.bit_length(),
            "**": lambda: right * left.bit_length() if right > 0 and abs(left) > 1 else 0}
    if ints and operator in bits and bits[operator]() > 4096:
        _refuse("computes an integer past 4096 bits")
    if operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
        _refuse("uses a format width or precision over 5 digits")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox plus resource limits.

    Relies on the sandbox for: no underscore/internal attribute access, no mutation of lists
    and dicts, a safe str.format, range() capped at 100k items. Adds: unsafe attribute access
    raises instead of rendering empty; every call and (through the AST rewrite in `_compile`)
    every loop iteration spends from a per-render budget with a deadline; `+`, `*`, `**`,
    `%`, `~`, printing, and size-multiplying filters/methods (join, replace, indent,
    expandtabs, wide formats) are checked before they allocate. Not covered: one C-level
    operation cannot be interrupted, and str() of a huge nested value through `~` or
    `|string` is checked only after it is built; full isolation would need a subprocess.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _spend()
        # The sandbox hands out str.format as a wrapper; the string is on the wrapped method.
        owner = getattr(obj, "__self__", None) or getattr(getattr(obj, "__wrapped__", None), "__self__", None)
        _check_args([*args, *kwargs.values()], owner, getattr(obj, "__name__", ""))
        return _check_size(super().call(context, obj, *args, **kwargs))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"chat templates may not access attribute {attribute!r} of a {type(obj).__name__}")


def _guard_filter(name: str, func: Any) -> Any:
    skip = 2 if getattr(func, "jinja_pass_arg", None) is not None else 1  # context/env first

    @functools.wraps(func)  # copies jinja_pass_arg, so jinja still passes the context
    def guarded(*args: Any, **kwargs: Any) -> Any:
        value = args[skip - 1] if len(args) >= skip else None
        _check_args([*args[skip:], *kwargs.values()], value, "format_map" if name == "format" else name)
        return _check_size(func(*args, **kwargs))

    return guarded


def _guard_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    for item in iterable:
        _spend()
        yield item


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # As in transformers: no HTML escaping, json.dumps options exposed (indent bounded).
    if indent is not None and not 0 <= int(indent) <= 16:
        _refuse(f"asks tojson for indent {indent}; allowed 0..16")
    _check_size(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _Guard(NodeTransformer):
    """Routes every for-loop iterable and every `~` concatenation through a checker."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_flashllm_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(node, "_flashllm_size", [], [], None, None, lineno=node.lineno)


def _make_environment() -> _BoundedSandbox:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_check_size)
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters.update(_flashllm_iter=_guard_iter, _flashllm_size=_check_size)
    env.globals.pop("lipsum", None)  # lorem-ipsum generator: a free CPU/memory sink
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> Any:
    try:
        ast = _ENV.parse(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from exc
    ast = _Guard().visit(ast)
    ast.set_environment(_ENV)
    return _ENV.from_string(ast)


# ---------------------------------------------------------------- messages


def validate_messages(messages: Any, tools: Any = None) -> None:
    """Check a chat request before rendering; raise ChatTemplateError naming the bad field.

    messages: non-empty list of {"role": system|user|assistant|tool, "content": str} (an
    assistant message with `tool_calls` may have null content); bounded count and length.
    tools: None or a list of JSON objects (function schemas).
    """
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        count = f" of {len(messages)}" if isinstance(messages, list) else ""
        raise ChatTemplateError(f"messages must be a list of 1 to {MAX_MESSAGES} {{role, content}} objects, "
                                f"got a {type(messages).__name__}{count}")
    total = 0
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}] must be an object whose role is one of "
                                    f"{', '.join(ROLES)}; got {message!r:.60}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue  # an assistant turn that only calls tools
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        total += len(content)
    if total > MAX_CONTENT_CHARS:
        raise ChatTemplateError(f"messages hold {total} characters; at most {MAX_CONTENT_CHARS}")
    if tools is not None and not (isinstance(tools, list) and len(tools) <= MAX_TOOLS
                                  and all(isinstance(t, dict) for t in tools)):
        raise ChatTemplateError(f"tools must be a list of at most {MAX_TOOLS} JSON objects")
    try:
        size = len(json.dumps([messages, tools], ensure_ascii=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ChatTemplateError(f"messages and tools must be plain JSON data: {exc}") from exc
    if size > MAX_JSON_CHARS:
        raise ChatTemplateError(f"messages and tools serialize to {size} characters; at most {MAX_JSON_CHARS}")


# ---------------------------------------------------------------- templates


class ChatTemplate:
    """A chat template compiled in the bounded sandbox, with the special tokens it expects.

    Rendering follows transformers' `apply_chat_template(tokenize=False)`: same jinja
    settings (trim_blocks, lstrip_blocks, loop controls), `raise_exception`, `strftime_now`,
    an unescaped `tojson`, and the variables messages, tools, add_generation_prompt,
    bos_token, eos_token plus any extra keyword arguments.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "default") -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, got {type(source).__name__}")
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"chat template {name!r} is {size} bytes; the limit is {MAX_TEMPLATE_BYTES}")
        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = _compile(source)

    @classmethod
    def builtin(cls, name: str, *, bos_token: str | None = None, eos_token: str | None = None) -> ChatTemplate:
        """A built-in template by name (see BUILTIN_TEMPLATES), with its usual special tokens."""
        if name not in BUILTIN_TEMPLATES:
            raise ChatTemplateError(f"no built-in chat template {name!r}; choose one of {', '.join(BUILTIN_TEMPLATES)}")
        source, bos, eos = BUILTIN_TEMPLATES[name]
        return cls(source, bos_token=bos if bos_token is None else bos_token,
                   eos_token=eos if eos_token is None else eos_token, name=name)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt string (not tokenized).

        Encode the result without adding special tokens: templates already write bos_token.
        """
        validate_messages(messages, tools)
        check_template_kwargs(kwargs)
        variables = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        token = _BUDGET.set(_Budget(MAX_RENDER_STEPS, time.monotonic() + MAX_RENDER_SECONDS))
        chunks, size = [], 0
        try:
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > MAX_RENDERED_CHARS:
                    _refuse(f"output exceeds {MAX_RENDERED_CHARS} characters")
                chunks.append(chunk)
        except ChatTemplateError:
            raise
        except (SecurityError, RecursionError) as exc:
            raise ChatTemplateSecurityError(f"chat template {self.name!r}: {exc!r}") from exc
        except (TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template {self.name!r} failed: {exc!r}") from exc
        finally:
            _BUDGET.reset(token)
        return "".join(chunks)


# What a caller's extra template variables (vLLM's chat_template_kwargs: Qwen3's enable_thinking, ...) may not be
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "raise_exception", "strftime_now", "namespace", "range", "dict", "cycler",
                                     "joiner"})
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARG_NAME = 64


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """ChatTemplateError unless every extra variable is a plain identifier a template could read and none
    replaces what render itself passes or the sandbox's globals (at most MAX_TEMPLATE_KWARGS of them)."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ChatTemplateError(f"at most {MAX_TEMPLATE_KWARGS} chat template variables, got {len(kwargs)}")
    for name in kwargs:
        if not (isinstance(name, str) and name.isidentifier() and not name.startswith("_")
                and len(name) <= MAX_TEMPLATE_KWARG_NAME):
            raise ChatTemplateError(f"chat template variable {str(name)[:MAX_TEMPLATE_KWARG_NAME]!r} is not a plain "
                                    f"identifier of at most {MAX_TEMPLATE_KWARG_NAME} characters")
        if name in RESERVED_TEMPLATE_NAMES:
            raise ChatTemplateError(f"chat template variable {name!r} is set by flashllm itself; choose another name")


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """ChatTemplateError for both continue_final_message and add_generation_prompt (vLLM refuses the pair too)."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message continues the last message, add_generation_prompt opens a "
                                "new one: set add_generation_prompt to false")


def continued_end(text: str, messages: list[dict[str, Any]]) -> int:
    """Where a rendered conversation stops when its last message is continued rather than closed (vLLM's
    and transformers' continue_final_message): just after that message's content, whose last occurrence
    in `text` it is (as written, or trimmed as templates often write it). ChatTemplateError where the
    last message has no text content or the template did not write it."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text content to continue")
    for written in (content, content.strip()):
        at = text.rfind(written)
        if at >= 0:
            return at + len(written)
    raise ChatTemplateError("continue_final_message: the chat template does not write the last message's content "
                            "as given, so there is no place to continue it from")


def render_chat(template: ChatTemplate | str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render `messages` with a ChatTemplate, a built-in name, or a template source string."""
    if isinstance(template, str):
        template = ChatTemplate.builtin(template) if template in BUILTIN_TEMPLATES else ChatTemplate(template)
    return template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
