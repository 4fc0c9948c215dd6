"""Evaluation inputs: JSONL {"src", "tgt"} examples, JSONL predictions and plain text files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# keys a predictions line may carry its text under: ours, and what `flashllm predict` writes
PREDICTION_KEYS = ("prediction", "output")


class EvalDataError(ValueError):
    """A bad evaluation input file; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Example:
    """One summarisation-style example: the source prompt and its reference text."""

    src: str
    tgt: str


def _json_lines(path: str | Path) -> list[tuple[str, Any]]:
    """(where, parsed value) of each non-blank line of a JSONL file."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as err:
                raise EvalDataError(f"{where}: not valid JSON ({err.msg}); expected one JSON object per line") from None
    if not rows:
        raise EvalDataError(f"{path} holds no records; expected one JSON object per line")
    return rows


def read_examples(path: str | Path) -> list[Example]:
    """Examples of a JSONL file whose lines are {"src": str, "tgt": str} (other keys are ignored)."""
    examples = []
    for where, item in _json_lines(path):
        if not isinstance(item, dict) or not isinstance(item.get("src"), str) or not isinstance(item.get("tgt"), str):
            raise EvalDataError(f'{where}: expected an object with string "src" and "tgt", got {str(item)[:80]!r}')
        examples.append(Example(item["src"], item["tgt"]))
    return examples


def read_predictions(path: str | Path) -> list[str]:
    """Prediction texts of a JSONL file: one JSON string or {"prediction"|"output": str} per line."""
    predictions = []
    for where, item in _json_lines(path):
        if isinstance(item, dict):
            item = next((item[k] for k in PREDICTION_KEYS if k in item), None)
        if not isinstance(item, str):
            raise EvalDataError(f"{where}: expected a JSON string or an object with a string "
                                f"{' or '.join(repr(k) for k in PREDICTION_KEYS)}")
        predictions.append(item)
    return predictions


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's content; an error naming the file when it is empty."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise EvalDataError(f"{path} is empty; give a text to score")
    return text
