"""Structured-output acceptance runs: requests over every JSON schema, regex and choice case, checked by oracles.

The oracles share no code with flashllm.structured or llguidance: an output that finishes with
`stop` must parse with `json` and validate with the `jsonschema` package (JSON), match with the
`regex` package (regex) or equal one of the strings (choice); an output cut off by `length` must be
a prefix of some valid output (flashllm.testing.structured.is_json_prefix, the regex package's
partial matching, str.startswith). Any other finish reason is a problem.

MEMORIZED_* hold, for each case, a line that breaks it in a way a model could plausibly write
(a number out of bounds, a value outside the enum, a string against its pattern): a tiny model
taught these lines wants to write them, so its constrained outputs validate only if the mask works.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flashllm.sampling_params import SamplingParams, StructuredOutput
from flashllm.testing.structured import CHOICES, JSON_SCHEMAS, REGEXES, is_json_prefix

# one per JSON_SCHEMAS[i] (the first 25), each invalid for its schema
MEMORIZED_JSON = [
    '{"name": "Alexander", "age": 130}', '{"ok": "yes"}', '{"color": "purple", "size": 4}', '{"x": 3.5, "y": 0}',
    '{"tags": []}', '{"point": {"x": 70, "y": -3}}', '{"a": {"b": {"c": {"d": 1}}}}', '{"v": 12}',
    '{"v": {"k": 99}}', '{"zip": "1234"}', '{"code": "abc-1", "n": 3}', '{"id": 42, "label": "other"}',
    '{"rows": [[1, 2, 3, 4]]}', '{"people": [{"n": "Al", "a": 3}, {"n": "Bo", "a": 4}, {"n": "Cy", "a": 5}]}',
    '{"opt": "x"}', '{"flag": true, "count": 7, "mode": "medium"}', '[1]', '"delta"', '12.5', '{"s": "a"}',
    '{"items": ["a", "c"], "total": 2}', '{"left": {"val": 1}, "right": {"value": 2}}',
    '{"kind": "triangle", "r": 1}', '{"date": "2026-13-40"}', '{"matrix": {"w": 0, "h": 5, "fill": 2}}',
]
MEMORIZED_REGEX = ["12-34567", "perhaps!", "hello World", "#GG00ZZ", "007.5", "abce", "abcd@y.com"]  # REGEXES
MEMORIZED_CHOICE = ["maybe", "dark blue", "ACE", "mixed"]  # CHOICES


def json_problems(schema: dict[str, Any], text: str, reason: str | None) -> str | None:
    """Why this output breaks its schema, or None. `stop`: parses and validates; `length`: a JSON prefix."""
    import jsonschema

    if reason == "length":
        return None if is_json_prefix(text) else f"cut-off output is no JSON prefix: {text!r}"
    if reason != "stop":
        return f"finish_reason {reason!r}: {text!r}"
    try:
        value = json.loads(text)
    except ValueError:
        return f"does not parse: {text!r}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"does not validate ({exc.message}): {text!r}"
    return None


def regex_problems(pattern: str, text: str, reason: str | None) -> str | None:
    """Why this output breaks /pattern/ (whole-text match; `length`: a partial match), or None."""
    import regex

    if reason == "length":
        return None if regex.fullmatch(pattern, text, partial=True) else f"no prefix of /{pattern}/: {text!r}"
    if reason != "stop" or regex.fullmatch(pattern, text) is None:
        return f"{reason}: does not match /{pattern}/: {text!r}"
    return None


def choice_problems(choices: list[str], text: str, reason: str | None) -> str | None:
    """Why this output is not one of `choices` (`length`: not a prefix of one), or None."""
    if reason == "length":
        return None if any(c.startswith(text) for c in choices) else f"no prefix of a choice: {text!r}"
    return None if reason == "stop" and text in choices else f"{reason}: {text!r} is not one of {choices}"


@dataclass(frozen=True)
class Case:
    """One constraint, the oracle that checks an output against it, and the line a memorizing model was taught."""

    name: str
    spec: StructuredOutput
    check: Callable[[str, str | None], str | None]  # (text, finish_reason) -> problem or None
    memorized: str | None = None


def all_cases() -> list[Case]:
    """Every JSON schema, regex and choice case (JSON_SCHEMAS, REGEXES, CHOICES), with its memorized line if any."""
    cases = []
    for i, schema in enumerate(JSON_SCHEMAS):
        line = MEMORIZED_JSON[i] if i < len(MEMORIZED_JSON) else None
        cases.append(Case(f"json#{i}", StructuredOutput(json=schema),
                          lambda t, r, s=schema: json_problems(s, t, r), line))
    for i, pattern in enumerate(REGEXES):
        cases.append(Case(f"regex#{i}", StructuredOutput(regex=pattern),
                          lambda t, r, p=pattern: regex_problems(p, t, r), MEMORIZED_REGEX[i]))
    for i, choices in enumerate(CHOICES):
        cases.append(Case(f"choice#{i}", StructuredOutput(choice=choices),
                          lambda t, r, c=choices: choice_problems(c, t, r), MEMORIZED_CHOICE[i]))
    return cases


def memorized_prompt(case: Case) -> str:
    """The prompt a memorizing model answers with case.memorized."""
    return f"Record {case.name}:"


@dataclass
class RunResult:
    """What a run of requests produced: the oracles' problems and the finish reasons counted."""

    problems: list[str]
    counts: dict[str, int]
    num_requests: int

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def run_cases(llm: Any, requests: Sequence[tuple[Case, str, SamplingParams]]) -> RunResult:
    """Generate every (case, prompt, params) in one batch with `llm` (an LLM) and check each completion."""
    outputs = llm.generate([prompt for _, prompt, _ in requests], [params for _, _, params in requests])
    problems: list[str] = []
    counts: dict[str, int] = {}
    for (case, _, _), output in zip(requests, outputs, strict=True):
        for completion in output.outputs:
            counts[str(completion.finish_reason)] = counts.get(str(completion.finish_reason), 0) + 1
            problem = case.check(completion.text, completion.finish_reason)
            if problem is not None:
                problems.append(f"{case.name}: {problem}")
    return RunResult(problems, counts, len(requests))
