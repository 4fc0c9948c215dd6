"""SamplingParams: how one request is decoded, validated once when it is built."""

from __future__ import annotations

import json as _json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is decoded greedily: dividing logits by a near-zero
# temperature only amplifies noise in the argmax and can overflow in low precision.
GREEDY_TEMPERATURE = 1e-5

MAX_N = 128
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0
MAX_SEED = 2**63 - 1
MAX_TOKENS_LIMIT = 1_000_000
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGPROBS = 20
MAX_ABS_LENGTH_PENALTY = 10.0
MAX_PRIORITY = 2**31 - 1  # a request's scheduling priority, either sign (vLLM's is an int)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token in practice, +100 forces it
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 128  # each is tokenized at add_request and checked against the output at every step
MAX_BAD_WORD_CHARS = 256
# Structured output: bounds on what a request may ask the grammar compiler to read (the compiler
# has its own limits on the work it does; these keep the inputs themselves small).
MAX_STRUCTURED_CHARS = 256 * 1024  # a schema (as JSON text), a regex or a grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# How a thinking model's reply opens with a think block (serving/reasoning.py reads replies by these rules;
# a constraint with `reasoning_parser` applies after the block): deepseek_r1, the block opened by the
# template, runs to the first THINK_END; qwen3, only a reply that starts with THINK_START has one.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    # bool is an int subclass; `n=True` is almost surely a bug in the caller.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> None:
    left = "(" if lo_open else "["
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in {left}{lo}, {hi}], got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number in {left}{lo}, {hi}], got {value}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"each stop string must be a string of 1 to {MAX_STOP_STRING_CHARS} characters, "
                f"got {s!r:.60}"
            )
    return list(stops)


def _normalize_token_ids(name: str, ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name} has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    for i, token_id in enumerate(ids):
        _check_int(f"{name}[{i}]", token_id, 0, MAX_TOKEN_ID)
    return list(ids)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; exactly one of the fields is set.

    json: a JSON schema (dict, or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches (Rust `regex` syntax); choice: one of these strings
    exactly; grammar: a context-free grammar in Lark syntax (llguidance's dialect) or GBNF (rules
    written `name ::= ...`). The output is constrained token by token (flashllm.structured) and
    stops where the grammar is complete.

    reasoning_parser (one of REASONING_PARSERS; it goes with any of the fields above): the output
    first holds a think block, free text, read by that parser's rule, and the constraint applies to
    what follows `</think>` (and up to two newlines); None constrains the whole output.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured output takes exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(set_fields) or 'none'}")
        _check_bool("json_object", self.json_object)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r:.60}")
        if self.json is not None:
            if not isinstance(self.json, (str, dict)):
                raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
            _check_text("json schema", self.key[1])
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"{name} must be a non-empty string, got {value!r:.60}")
                _check_text(name, value)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} strings")
            for c in self.choice:
                if not isinstance(c, str) or not 1 <= len(c) <= MAX_CHOICE_CHARS:
                    raise ValueError(f"each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters, "
                                     f"got {c!r:.60}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which field is set: one of STRUCTURED_KINDS."""
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            try:
                value = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
            except (RecursionError, TypeError, ValueError) as exc:
                raise ValueError(f"the json schema cannot be written as JSON ({type(exc).__name__}); "
                                 "send a JSON object of plain values, nested at most a few hundred levels") from None
        elif kind == "choice":
            value = _json.dumps(list(self.choice or ()))
        else:
            value = "" if kind == "json_object" else str(getattr(self, kind))
        return kind, value


def _check_text(name: str, text: str) -> None:
    if len(text) > MAX_STRUCTURED_CHARS:
        raise ValueError(f"the {name} has {len(text)} characters; at most {MAX_STRUCTURED_CHARS} are allowed")


POOLING_TYPES = ("last", "mean", "cls")
MAX_EMBEDDING_DIMENSIONS = 1 << 16


@dataclass(frozen=True)
class Pooling:
    """How a prompt's hidden states (the model's last layer, after its final norm) become one embedding.

    type: "last" (the last prompt token's state: decoder embedding models such as Qwen3-Embedding),
    "mean" (the average over the prompt's tokens) or "cls" (the first token's); dimensions: keep the first
    this many features (Matryoshka embeddings), before normalizing; normalize: scale to unit L2 norm.
    """

    type: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.type!r:.40}")
        _check_bool("normalize", self.normalize)
        if self.dimensions is not None:
            _check_int("dimensions", self.dimensions, 1, MAX_EMBEDDING_DIMENSIONS)


@dataclass
class SamplingParams:
    """Decoding settings of one request (OpenAI / vLLM field names and meanings).

    Validated once in `__post_init__`: every numeric field is bounded and finite, and a bad
    value raises ValueError naming the field, the value and the allowed range.
    `temperature=0` means greedy decoding; `top_k` of -1 or 0 and `top_p=1` switch those
    filters off; `logprobs=k` returns the sampled token's logprob plus the k most likely.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only, no text (benchmarks, token-id clients)
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    structured_output: StructuredOutput | None = None  # constrain the output (JSON schema, regex, ...)
    prompt_logprobs: int | None = None  # each prompt token's logprob (+ this many most likely); no prefix cache
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated (vLLM's)
    # an embedding request (LLM.embed, /v1/embeddings): the prompt's pooled hidden state is the result
    pooling: Pooling | None = None
    bad_words: list[str] | None = None  # words the output must not contain as token sequences (vLLM's)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1, MAX_TOP_K)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
                     lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        max_min_tokens = MAX_TOKENS_LIMIT if self.max_tokens is None else self.max_tokens
        _check_int("min_tokens", self.min_tokens, 0, max_min_tokens)
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_token_ids("stop_token_ids", self.stop_token_ids)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize",
                     "use_beam_search"):
            _check_bool(name, getattr(self, name))
        self._check_beam_search()
        self._check_structured()
        self._check_token_biases()
        if self.pooling is not None and (not isinstance(self.pooling, Pooling) or self.n != 1):
            raise ValueError("pooling must be a flashllm.sampling_params.Pooling, with n=1")
        self._check_bad_words()
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, MAX_TOKENS_LIMIT)

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if words is None:
            return
        if not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings")
        for i, word in enumerate(words):
            # vLLM strips leading whitespace before tokenizing (the word is banned with and without a space
            # before it), so a word of only whitespace would ban nothing
            if not isinstance(word, str) or not 1 <= len(word) <= MAX_BAD_WORD_CHARS or not word.lstrip():
                raise ValueError(f"bad_words[{i}] must be a string of 1 to {MAX_BAD_WORD_CHARS} characters, "
                                 f"not only whitespace; got {word!r:.60}")
        self.bad_words = list(words) or None

    def _check_token_biases(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token_id, 0, MAX_TOKEN_ID)
                _check_float(f"logit_bias[{token_id}]", bias, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must be a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
            for token_id in ids:
                _check_int("allowed_token_ids entry", token_id, 0, MAX_TOKEN_ID)
            self.allowed_token_ids = list(ids)

    def token_ids_outside(self, vocab_size: int) -> list[int]:
        """The logit_bias and allowed_token_ids ids a model of `vocab_size` tokens does not have (the first few)."""
        ids = [*(self.logit_bias or ()), *(self.allowed_token_ids or ())]
        return [t for t in ids if t >= vocab_size][:5]

    def _check_structured(self) -> None:
        if self.structured_output is None:
            return
        if not isinstance(self.structured_output, StructuredOutput):
            raise ValueError("structured_output must be a flashllm.sampling_params.StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")
        if self.use_beam_search:
            raise ValueError("structured output does not combine with beam search (each beam would need its "
                             "own grammar state); use sampling or greedy decoding with structured output")

    def _check_beam_search(self) -> None:
        _check_float("length_penalty", self.length_penalty, -MAX_ABS_LENGTH_PENALTY,
                     MAX_ABS_LENGTH_PENALTY)
        if self.beam_width is None:
            return
        _check_int("beam_width", self.beam_width, 1, MAX_N)
        if not self.use_beam_search:
            raise ValueError("beam_width is only meaningful with use_beam_search=True; "
                             "set use_beam_search or drop beam_width")
        if self.beam_width < self.n:
            raise ValueError(f"beam_width ({self.beam_width}) must be >= n ({self.n}): "
                             "n beams are returned out of beam_width kept")

    @property
    def runs_every_prompt_position(self) -> bool:
        """True when every prompt position must run through the model (no prefix-cache hit): prompt logprobs,
        and pooling over more than the last token."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.type != "last")

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0, or below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_beams(self) -> int:
        """Beams kept per step under beam search: beam_width, or n when beam_width is unset."""
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def max_stop_str_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def from_generation_config(cls, config: dict[str, Any] | None, **overrides: Any) -> SamplingParams:
        """Build params from a HF `generation_config.json` dict, then apply `overrides`.

        Reads temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (JSON
        nulls are skipped). An explicit `do_sample: false` means greedy (temperature 0), as
        in transformers; a missing `do_sample` keeps the file's sampling values, because many
        checkpoints ship tuned values without the flag. `overrides` win over the file.
        """
        config = config or {}
        kwargs: dict[str, Any] = {}
        for hf_name, name in (("temperature", "temperature"), ("top_p", "top_p"),
                              ("top_k", "top_k"), ("min_p", "min_p"),
                              ("repetition_penalty", "repetition_penalty"),
                              ("max_new_tokens", "max_tokens")):
            if config.get(hf_name) is not None:
                kwargs[name] = config[hf_name]
        if config.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        kwargs.update(overrides)
        return cls(**kwargs)


def per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int,
               default: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per prompt: `default` for None, one shared by all, or exactly `count` given.

    LLM.generate and StaticLLM.generate both take their `sampling_params` this way.
    """
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    return list(params)
