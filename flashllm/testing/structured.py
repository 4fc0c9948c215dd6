"""Oracles and cases for structured-output tests: JSON-prefix syntax, 25+ schemas, regex and choice cases.

The checks here share no code with flashllm.structured or llguidance: outputs that finish are parsed
with `json` and validated with the `jsonschema` package, regexes are matched with the `regex`
package (its partial matching decides whether a cut-off output can still match), and cut-off JSON
is read by the small scanner below, which knows JSON's syntax and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = set("0123456789+-.eE")


def is_json_prefix(text: str) -> bool:
    """True when `text` is the beginning of some JSON document (syntax only; the empty text is one)."""
    stack: list[str] = []  # "{" or "["
    # what may come next: value, key (or "}" when first), colon, comma_or_close, or end
    expect = "value"
    first_in_container = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if expect == "end":
            return False
        if expect in ("value", "key"):
            closes_empty = (c == "}" if expect == "key" else c == "]" and bool(stack) and stack[-1] == "[")
            if first_in_container and closes_empty:
                stack.pop()
                expect, first_in_container = ("comma_or_close" if stack else "end"), False
                i += 1
                continue
            if c == '"':
                end = _string_end(text, i + 1)
                if end is None:
                    return _string_prefix_ok(text, i + 1)
                i = end
                if expect == "key":
                    expect = "colon"
                else:
                    expect = "comma_or_close" if stack else "end"
                first_in_container = False
                continue
            if expect == "key":
                return False
            if c in "{[":
                stack.append(c)
                expect, first_in_container = ("key" if c == "{" else "value"), True
                i += 1
                continue
            if c in "-0123456789":
                j = i
                while j < n and text[j] in _NUMBER_CHARS:
                    j += 1
                token = text[i:j]
                if j == n:
                    return _number_prefix_ok(token)
                if not _number_ok(token):
                    return False
                i, expect, first_in_container = j, ("comma_or_close" if stack else "end"), False
                continue
            literal = next((w for w in _LITERALS if text.startswith(w[: n - i], i) and c == w[0]), None)
            if literal is None:
                return False
            if n - i < len(literal):
                return True
            i += len(literal)
            expect, first_in_container = ("comma_or_close" if stack else "end"), False
            continue
        if expect == "colon":
            if c != ":":
                return False
            expect = "value"
            i += 1
            continue
        if expect == "comma_or_close":
            if c == ",":
                expect = "key" if stack[-1] == "{" else "value"
            elif c == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                expect = "comma_or_close" if stack else "end"
            else:
                return False
            first_in_container = False
            i += 1
            continue
    return True


def _string_end(text: str, i: int) -> int | None:
    """Index just past the closing quote of the string whose body starts at i, or None if it is cut off."""
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _string_prefix_ok(text: str, i: int) -> bool:
    """A cut-off string body: escapes and characters legal so far."""
    while i < len(text):
        c = text[i]
        if ord(c) < 0x20:
            return False
        if c == "\\":
            rest = text[i + 1: i + 6]
            if not rest:
                return True
            if rest[0] == "u":
                hexpart = rest[1:]
                return all(h in "0123456789abcdefABCDEF" for h in hexpart) if len(rest) < 5 else \
                    all(h in "0123456789abcdefABCDEF" for h in hexpart) and _string_prefix_ok(text, i + 6)
            if rest[0] not in '"\\/bfnrt':
                return False
            i += 2
            continue
        i += 1
    return True


def _number_ok(token: str) -> bool:
    try:
        json.loads(token)
    except ValueError:
        return False
    return True


def _number_prefix_ok(token: str) -> bool:
    return any(_number_ok(token + tail) for tail in ("", "0", "1", ".0", "e0", "0e0"))


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


_SHORT = {"type": "string", "maxLength": 8}
_INT = {"type": "integer", "minimum": -50, "maximum": 50}

JSON_SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}),
    _obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}, "y": {"type": "number", "exclusiveMinimum": 0,
                                                                           "maximum": 10}}),
    _obj({"tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}}),
    _obj({"point": _obj({"x": _INT, "y": _INT})}),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    _obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}}),
    _obj({"v": {"anyOf": [_SHORT, _obj({"k": _INT})]}}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,4}$"}, "n": _INT}),
    _obj({"id": {"type": "integer", "minimum": 100, "maximum": 999}, "label": {"const": "fixed"}}),
    _obj({"rows": {"type": "array", "items": {"type": "array", "items": _INT, "maxItems": 3}, "maxItems": 3}}),
    _obj({"people": {"type": "array", "items": _obj({"n": _SHORT, "a": _INT}), "maxItems": 2}}),
    _obj({"opt": _SHORT, "req": _INT}, required=["req"]),
    _obj({"flag": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 3},
          "mode": {"enum": ["fast", "slow", None]}}),
    {"type": "array", "items": _INT, "minItems": 2, "maxItems": 4},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": -1000, "maximum": 1000},
    _obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    _obj({"items": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
          "total": {"type": "number", "minimum": 0, "maximum": 1}}),
    {"$defs": {"leaf": _obj({"val": _INT})}, **_obj({"left": {"$ref": "#/$defs/leaf"},
                                                     "right": {"$ref": "#/$defs/leaf"}})},
    _obj({"kind": {"anyOf": [{"const": "circle"}, {"const": "square"}]}, "r": {"type": "number", "minimum": 0,
                                                                               "maximum": 5}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$"}}),
    _obj({"matrix": _obj({"w": {"type": "integer", "minimum": 1, "maximum": 4},
                          "h": {"type": "integer", "minimum": 1, "maximum": 4},
                          "fill": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"enum": [0, 1]}]}})}),
    _obj({"nested": {"type": "array", "items": _obj({"k": {"enum": ["p", "q"]},
                                                     "v": {"type": "array", "items": {"type": "boolean"},
                                                           "maxItems": 2}}), "minItems": 1, "maxItems": 2}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}}),
]

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}",
           r"#[0-9a-f]{6}", r"-?(0|[1-9][0-9]{0,3})\.[0-9]{2}", r"(ab|cd)+e", r"[a-c]{2,5}@x\.(io|dev)"]
CHOICES = [["yes", "no"], ["red", "green", "blue", "light blue"], ["A", "AB", "ABC"], ["positive", "negative",
                                                                                      "neutral"]]
