"""Speculative decoding flags (PaddleNLP's names, vLLM's form), declared once for every command that builds an engine."""

from __future__ import annotations

import argparse
import json
from typing import Any

from flashllm.config import MAX_DRAFT_TOKENS, SPECULATE_METHODS, speculative_flags_config


def on_off(text: str) -> bool:
    """A yes/no flag's value: 1/0, true/false, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1 or 0 (true/false, yes/no, on/off), got {text!r}")


def json_object(text: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON object's text (or, from a YAML --config, the mapping itself) as a dict."""
    if isinstance(text, dict):
        value: Any = text
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"method\": \"ngram\"}}', got {text!r}")
    return value


# dest -> (spellings, type, help); every spelling also has its other-case twin (- or _)
SPEC_FLAGS: dict[str, tuple[tuple[str, ...], Any, str]] = {
    "speculate_method": (("--speculate_method",), str,
                         f"speculative decoding: {' | '.join(SPECULATE_METHODS)} (inference_with_reference is the "
                         "n-gram lookup in the prompt and output; draft_model, eagle and eagle3 need --speculative-model "
                         "(a draft model, an EAGLE-1 or EAGLE-3 head: eagle loads either); mtp drafts with a DeepSeek-V3 or GLM-4.5 checkpoint's own "
                         "next-token-prediction layer)"),
    "speculate_max_draft_token_num": (("--speculate_max_draft_token_num", "--num_speculative_tokens"), int,
                                      f"tokens drafted per sequence and round, 1..{MAX_DRAFT_TOKENS} (default 4)"),
    "speculate_max_ngram_size": (("--speculate_max_ngram_size",), int,
                                 "n-gram lookup: the longest suffix matched (default 3)"),
    "speculative_model": (("--speculative_model",), str,
                          "draft model or EAGLE head directory (same vocabulary as the model); implies "
                          "draft_model unless --speculate_method eagle or eagle3"),
    "speculative_quant_type": (("--speculative_quant_type",), str,
                               "weight-only quantization of the draft model (e.g. weight_only_int8)"),
    "speculative_weightonly_group_size": (("--speculative_weightonly_group_size",), int,
                                          "the draft model's weight-only group size: -1 (per output channel, the "
                                          "default) or a group of input features, e.g. 32 or 64"),
    "speculative_draft_vocab": (("--speculative_draft_vocab",), int,
                                "the draft model's greedy head scores token ids below this plus every token of the "
                                "drafted sequences (default 4096; 0: the whole vocabulary); tokens stay exact"),
    "speculative_config": (("--speculative_config",), json_object,
                           "all of it as one JSON object in vLLM's form, e.g. '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}' or '{\"model\": DIR, "
                           "\"quantization\": \"weight_only_int4\"}' (PaddleNLP's key names work too); a flag "
                           "above may add a key it lacks"),
    "speculative_draft_lookup": (("--speculative_draft_lookup",), on_off,
                                 "1 (default) or 0 (also true/false, yes/no, on/off): the draft model checks the "
                                 "n-gram lookup's guesses at its next tokens in one pass of several rows, so a run of "
                                 "right guesses costs one draft pass; the drafts are the draft model's own either way"),
}


def spellings(dest: str) -> list[str]:
    """Every command-line spelling of one flag: snake_case (PaddleNLP) and kebab-case (vLLM)."""
    names: list[str] = []
    for name in SPEC_FLAGS[dest][0]:
        names += [name, "--" + name[2:].replace("_", "-")]
    return names


def add_speculative_flags(parser: Any) -> None:
    """Add the flags to an argparse parser or argument group (defaults None: not given)."""
    for dest, (_, kind, text) in SPEC_FLAGS.items():
        parser.add_argument(*spellings(dest), dest=dest, type=kind, default=None, help=text)


def speculative_config(values: dict[str, Any] | argparse.Namespace) -> dict[str, Any] | None:
    """The parsed flags as LLM(speculative_config=...), or None when speculation was not asked for."""
    get = values.get if isinstance(values, dict) else lambda key: getattr(values, key, None)
    return speculative_flags_config(get)
