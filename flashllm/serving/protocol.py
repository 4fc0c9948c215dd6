"""OpenAI request bodies with strict types and bounds; errors in OpenAI's shape."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from flashllm.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_EMBEDDING_DIMENSIONS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    SamplingParams,
    StructuredOutput,
)

MAX_N = 16
MAX_PROMPTS = 64
MAX_MESSAGES = 1024
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 1 << 20
MAX_PROMPT_TOKEN_IDS = 1 << 17
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# pydantic names the member of a union field in `loc` ("str", "list[int]", ...); those are not fields
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_union_tag(part: str | int) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def _msg(error: Any) -> str:
    return str(error["msg"]).removeprefix("Value error, ")  # our validators' own words are enough


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (never the input echo or a path).

    For a union field (`stop`, `prompt`, message `content`, ...) every member fails; the message
    names the field, the accepted forms and the error of the member that got furthest.
    """
    errors = exc.errors(include_url=False, include_input=False)
    loc = errors[0]["loc"]
    tag_at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag_at is None:
        param = ".".join(str(part) for part in loc) or None
        message = _msg(errors[0]) if param is None else f"{param}: {_msg(errors[0])}"
        return APIError(400, message, param=param, code="invalid_value")
    field = loc[:tag_at]
    param = ".".join(str(part) for part in field)
    members = [e for e in errors if e["loc"][:tag_at] == field and len(e["loc"]) > tag_at]
    forms = ", ".join(dict.fromkeys(str(e["loc"][tag_at]) for e in members))
    message = f"{param}: matches none of the accepted forms ({forms})"
    closest = max(members, key=lambda e: len(e["loc"]))
    if len(closest["loc"]) > tag_at + 1:
        where = ".".join(str(part) for part in closest["loc"] if not _is_union_tag(part))
        message += f"; closest: {where}: {_msg(closest)}"
    return APIError(400, message, param=param, code="invalid_value")


def _continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """chat_template.check_continuation as a 400 naming continue_final_message."""
    from flashllm.models.chat_template import ChatTemplateError, check_continuation

    try:
        check_continuation(continue_final_message, add_generation_prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="continue_final_message") from None


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs checked as the sandboxed renderer checks them (names, count)."""
    from flashllm.models.chat_template import ChatTemplateError, check_template_kwargs

    if kwargs is not None:
        try:
            check_template_kwargs(kwargs)
        except ChatTemplateError as exc:
            raise ValueError(str(exc)) from None
    return kwargs


# vLLM's chat_template_kwargs: extra template variables (Qwen3's enable_thinking, ...)
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)]


class RequestModel(BaseModel):
    # strict: "5" is not an int and true is not a number; NaN/Infinity are refused everywhere.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


Stop = str | list[str] | None


class JSONSchemaFormat(RequestModel):
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    description: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names, plus vLLM extras)."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # OpenAI's token id (as a decimal string) -> bias, and vLLM's allow-list of token ids
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: words the output must not contain (as the tokenizer spells them), and left truncation of the prompt
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    # vLLM's: with serve --scheduling-policy priority, lower runs first
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output (OpenAI's response_format and vLLM's guided_* extras; flashllm/serving/structured.py)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, max_length=MAX_STRUCTURED_CHARS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: Stop) -> Stop:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and not all(_TOKEN_ID_KEY.fullmatch(key) for key in bias):
            raise ValueError("logit_bias keys must be token ids written as decimal integers, e.g. {\"50256\": -100}")
        return bias

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, words: list[str] | None) -> list[str] | None:
        if words and not all(word.strip() for word in words):
            raise ValueError("each bad word must hold a character other than whitespace")
        return words

    def truncated(self, prompts: list[list[int]]) -> list[list[int]]:
        """truncate_prompt_tokens: each prompt's last k token ids (vLLM's left truncation); unchanged without."""
        keep = self.truncate_prompt_tokens
        return prompts if keep is None else [p[-keep:] for p in prompts]

    def token_ids_biased(self) -> dict[str, list[int]]:
        """The token ids logit_bias and allowed_token_ids name, by field (for the vocabulary check)."""
        return {"logit_bias": [int(k) for k in self.logit_bias or ()], "allowed_token_ids": self.allowed_token_ids or []}

    def _check_budget(self, max_tokens: int | None, name: str = "max_tokens") -> None:
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) must not exceed {name} ({max_tokens})",
                           param="min_tokens")

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int, num_logprobs: int | None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """SamplingParams for this request; unset fields take the model's generation_config defaults."""
        chosen = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                  if getattr(self, k) is not None}
        merged = {**defaults, **chosen}
        return SamplingParams(
            n=self.n, seed=self.seed, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
            stop=self.stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logprobs=num_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_output=structured,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words, **merged,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


Prompt = str | list[str] | list[int] | list[list[int]]


def check_prompts(prompt: Prompt) -> Prompt:
    """A prompt field (text, token ids, or a list of either) within the request bounds; ValueError otherwise."""
    if isinstance(prompt, str):
        if len(prompt) > MAX_TEXT_CHARS:
            raise ValueError(f"the prompt is longer than {MAX_TEXT_CHARS} characters")
        return prompt
    if not prompt:
        raise ValueError("the prompt list is empty")
    if isinstance(prompt[0], list) or isinstance(prompt[0], str):
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        for item in prompt:
            check_prompts(item)
        return prompt
    if len(prompt) > MAX_PROMPT_TOKEN_IDS or any(not 0 <= t <= MAX_TOKEN_ID for t in prompt):
        raise ValueError(f"token-id prompts hold at most {MAX_PROMPT_TOKEN_IDS} ids in [0, {MAX_TOKEN_ID}]")
    return prompt


def prompt_list(prompt: Prompt) -> list[str | list[int]]:
    """A prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Prompt) -> Prompt:
        return check_prompts(prompt)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        return prompt_list(self.prompt)

    def check(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix is not supported by flashllm; leave it out", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of must equal n (flashllm returns every generated sequence)", param="best_of")
        if len(self.prompts()) * self.n > MAX_PROMPTS:
            raise APIError(400, f"prompts x n must be at most {MAX_PROMPTS}", param="n")
        self._check_budget(self.max_tokens)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class FunctionCall(RequestModel):
    name: str = Field(max_length=MAX_NAME_CHARS)
    arguments: str = Field(max_length=MAX_TEXT_CHARS)


class MessageToolCall(RequestModel):
    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # an earlier reply's reasoning (serve --reasoning-parser), which templates such as Qwen3's render back
    reasoning_content: str | None = Field(None, max_length=MAX_TEXT_CHARS)

    @field_validator("content")
    @classmethod
    def _check_content(cls, content: str | list[TextPart] | None) -> str | list[TextPart] | None:
        if isinstance(content, str) and len(content) > MAX_TEXT_CHARS:
            raise ValueError(f"message content is longer than {MAX_TEXT_CHARS} characters")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content a string; tool calls with dict arguments."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": text or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in self.tool_calls]
        return message


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None
    continue_final_message: bool = False  # vLLM's: the reply continues the last message (with add_generation_prompt off)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        self.num_logprobs()
        _continuation(self.continue_final_message, self.add_generation_prompt)
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        self._check_budget(self.requested_max_tokens, name)


class TokenizeRequest(RequestModel):
    """POST /tokenize, as vLLM takes it: a completion prompt (`prompt`) or chat messages (`messages`)."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    add_special_tokens: bool = True  # the completion form: the tokenizer's BOS and the like
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: TemplateKwargs = None
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt (a completion prompt) or messages (a chat), not both or neither",
                           param="prompt")
        _continuation(self.continue_final_message, self.add_generation_prompt)


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings (OpenAI's): one embedding per input (text, token ids, or a list of either)."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_EMBEDDING_DIMENSIONS)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)  # vLLM's: keep the last k tokens
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # serve --scheduling-policy priority: lower first

    @field_validator("input")
    @classmethod
    def _check_input(cls, prompt: Prompt) -> Prompt:
        return check_prompts(prompt)


class DetokenizeRequest(RequestModel):
    """POST /detokenize: token ids back to text."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[int] = Field(max_length=MAX_PROMPT_TOKEN_IDS)


def parse_body(model: type[RequestModel], body: bytes) -> Any:
    """Validate a JSON body against `model`; APIError 400 on any problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        invalid = [e for e in exc.errors(include_url=False, include_input=False) if e["type"] == "json_invalid"]
        if invalid:
            # jiter's reason carries only a position (line, column) or the nesting limit, never the input
            reason = invalid[0].get("ctx", {}).get("error", "")
            raise APIError(400, f"the request body is not valid JSON ({reason}); send one JSON object",
                           code="invalid_json") from None
        raise validation_error(exc) from None
