"""POST /v1/completions and /v1/chat/completions: validation, templating, streamed and whole responses."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.serving.chat_prompt import chat_prompt_ids, tokens_past_context
from flashllm.serving.generation import (
    Generation,
    ServerContext,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    usage,
)
from flashllm.serving.harmony import PARSER as HARMONY_PARSER
from flashllm.serving.harmony import HarmonySplitter
from flashllm.serving.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, parse_body
from flashllm.serving.reasoning import ReasoningSplitter, reasoning_splitter, split_reasoning
from flashllm.serving.structured import from_request, precompile, tool_call_constraint
from flashllm.serving.tool_calls import MAX_TOOL_CALLS, check_tool_choice
from flashllm.serving.tool_parsers import READS_SPECIAL_TOKENS, parse_reply, stream_parser

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Characters that str.splitlines() and some SSE clients treat as line breaks; JSON may escape them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n".encode()


def check_model(ctx: ServerContext, model: str | None) -> Any:
    """The LoRARequest `model` names (None: the base model); 404 in OpenAI's shape for any other name."""
    if model is None or model == ctx.model_name or model in ctx.model_aliases:
        return None
    lora = ctx.loras.get(model)
    if lora is None:
        adapters = f" and adapters {sorted(ctx.loras)[:20]}" if ctx.loras else ""
        raise APIError(404, f"model {model!r} is not served here; this server serves {ctx.model_name!r}{adapters}",
                       param="model", code="model_not_found")
    return lora


_CONTEXT_ROOM = "this model's context is {} tokens and must leave room for at least one generated token"


def _prompt_has(param: str) -> str:
    """The start of a context-length error, naming the request field the prompt came from."""
    return "the messages make a prompt of" if param == "messages" else "the prompt has"


def max_tokens_for(ctx: ServerContext, prompts: list[list[int]], requested: int | None, default: int | None,
                prompt_param: str, budget_param: str) -> int:
    """The generation budget, refusing prompts that leave no room (400 naming both numbers)."""
    longest = max(len(p) for p in prompts)
    room = ctx.max_model_len - longest
    if any(not p for p in prompts):
        raise APIError(400, "the prompt is empty: give at least one token", param=prompt_param)
    if room < 1:
        raise APIError(400, f"{_prompt_has(prompt_param)} {longest} tokens; "
                       f"{_CONTEXT_ROOM.format(ctx.max_model_len)}", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"{budget_param} ({requested}) + prompt tokens ({longest}) exceed the context of "
                       f"{ctx.max_model_len} tokens; lower {budget_param} to at most {room}", param=budget_param,
                       code="context_length_exceeded")
    return requested


async def _refuse_text_past_context(ctx: ServerContext, texts: list[str], param: str) -> None:
    """400 for a text whose prefix already holds more tokens than the context, before tokenizing it whole
    (a chat message's content counts as a prompt: its tokens are all in the rendered prompt)."""
    if not texts:
        return
    longest = await asyncio.to_thread(tokens_past_context, ctx.tokenizer, texts, ctx.max_model_len)
    if longest is not None:
        raise APIError(400, f"{_prompt_has(param)} more than {longest} tokens; "
                       f"{_CONTEXT_ROOM.format(ctx.max_model_len)}", param=param, code="context_length_exceeded")


def check_vocab(ctx: ServerContext, prompts: list[list[int]], param: str = "prompt") -> None:
    vocab = ctx.vocab_size
    if vocab is None:
        return
    for ids in prompts:
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)


def check_priority(ctx: ServerContext, priority: int) -> int:
    """A request's priority, which only a server started with --scheduling-policy priority takes (400)."""
    if priority and ctx.scheduling_policy != "priority":
        raise APIError(400, "priority needs a server started with --scheduling-policy priority; leave it 0",
                       param="priority")
    return priority


def check_biased_ids(ctx: ServerContext, req: Any) -> None:
    """logit_bias and allowed_token_ids may name only the model's tokens; bad_words needs a tokenizer."""
    for param, ids in req.token_ids_biased().items():
        check_vocab(ctx, [ids], param)
    if req.bad_words and ctx.tokenizer is None:
        raise APIError(400, "bad_words needs the model's tokenizer and this model has none; "
                       "ban token ids with logit_bias (-100) instead", param="bad_words")


async def tokenize_prompts(ctx: ServerContext, texts: list[str | list[int]], param: str,
                           refuse_past_context: bool = True) -> list[list[int]]:
    """Text prompts tokenized (token-id ones kept), off the event loop; 400 for text without a tokenizer, text
    past the context (unless refuse_past_context is off), and ids outside the vocabulary."""
    if any(isinstance(p, str) for p in texts) and ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send prompts as token ids", param=param)
    if refuse_past_context:
        await _refuse_text_past_context(ctx, [p for p in texts if isinstance(p, str)], param)
    prompts = await asyncio.to_thread(lambda: [ctx.tokenizer.encode(p) if isinstance(p, str) else list(p)
                                               for p in texts])
    check_vocab(ctx, prompts, param)
    return prompts


async def create_completion(ctx: ServerContext, http: HTTPRequest, body: bytes) -> Response:
    req: CompletionRequest = parse_body(CompletionRequest, body)
    req.check()
    lora = check_model(ctx, req.model)
    texts = req.prompts()
    # with truncate_prompt_tokens a text past the context may still keep its last tokens
    whole = await tokenize_prompts(ctx, texts, "prompt", refuse_past_context=req.truncate_prompt_tokens is None)
    prompts = req.truncated(whole)
    check_biased_ids(ctx, req)
    max_tokens = max_tokens_for(ctx, prompts, req.max_tokens, 16, "prompt", "max_tokens")
    spec, param = from_request(req)
    await precompile(ctx, spec, param)
    params = req.sampling_params(ctx.defaults, max_tokens, req.logprobs, spec)
    if req.echo and req.logprobs is not None:  # the prompt's own logprobs, computed during prefill
        if not ctx.engine.paged:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which static mode does not compute; "
                           "restart the server with --mode dynamic", param="echo")
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    gen = Generation(ctx, prompts, params, lora, priority=check_priority(ctx, req.priority))
    gen.reserve()
    # a truncated prompt echoes the tokens the model saw
    echo = [p if isinstance(p, str) and len(ids) == len(w) else ctx.tokenizer.decode(ids) if ctx.tokenizer else ""
            for p, ids, w in zip(texts, prompts, whole, strict=True)] if req.echo else None
    if req.stream:
        return StreamingResponse(_completion_stream(gen, req, echo), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        finals = await gen.final_outputs(http)
    except asyncio.CancelledError:
        return Response(status_code=499)
    choices = []
    for p, output in enumerate(finals):
        head = echo_logprobs(ctx.tokenizer, output) if echo and req.logprobs is not None else None
        start = sum(len(t) for t in head["tokens"]) if head else 0
        for completion in output.outputs:
            logprobs = completion_logprobs(ctx.tokenizer, completion, 0, len(completion.token_ids), start)
            choices.append({
                "index": p * req.n + completion.index,
                "text": (echo[p] if echo else "") + completion.text,
                "logprobs": join_logprobs(head, logprobs) if head else logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            })
    return JSONResponse({"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created,
                         "model": gen.model_name, "choices": choices, "usage": usage(prompts, finals)})


async def _completion_stream(gen: Generation, req: CompletionRequest, echo: list[str] | None
                             ) -> AsyncIterator[bytes]:
    ctx = gen.ctx
    sent: dict[tuple[int, int], int] = {}  # (prompt, seq) -> tokens already streamed
    offsets: dict[tuple[int, int], int] = {}
    done: set[tuple[int, int]] = set()
    finals: dict[int, RequestOutput] = {}
    latest: dict[int, RequestOutput] = {}  # each prompt's newest output, for continuous usage stats
    head = {"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created, "model": gen.model_name}
    try:
        async for p, output in gen.stream():
            latest[p] = output
            so_far = {"usage": usage(gen.prompts, list(latest.values()))} if req.continuous_usage else {}
            for c in output.outputs:
                key = (p, c.index)
                if key in done:
                    continue  # a finished choice is repeated in every later output of its request
                done.update([key] if c.finished else [])
                start, end = sent.get(key, 0), len(c.token_ids)
                if start == end and not c.finished and not c.delta:
                    continue
                first = key not in sent
                prefix = echo[p] if echo and first else ""
                sent[key] = end
                echoed = echo_logprobs(ctx.tokenizer, output) if first and echo and req.logprobs is not None else None
                if echoed:
                    offsets[key] = sum(len(t) for t in echoed["tokens"])
                logprobs = completion_logprobs(ctx.tokenizer, c, start, end, offsets.get(key, 0))
                offsets[key] = offsets.get(key, 0) + sum(len(t) for t in (logprobs or {}).get("tokens", []))
                logprobs = join_logprobs(echoed, logprobs) if echoed else logprobs
                yield sse({**head, "choices": [{"index": p * req.n + c.index, "text": prefix + c.delta,
                                                "logprobs": logprobs, "finish_reason": c.finish_reason}], **so_far})
            if output.finished:
                finals[p] = output
    except APIError as err:
        yield sse(err.body())
        return
    if req.include_usage:
        yield sse({**head, "choices": [], "usage": usage(gen.prompts, list(finals.values()))})
    yield sse("[DONE]")


async def render_chat(ctx: ServerContext, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                      add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None,
                      refuse_past_context: bool = True, continue_final_message: bool = False) -> list[int]:
    """The chat template's prompt ids for these messages (400 for a model without a template, a render error
    or, with `refuse_past_context`, a message already longer than the context)."""
    if ctx.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions or start the server with "
                       "--chat-template", param="messages")
    turns = [m.for_template() for m in messages]

    def render() -> list[int]:
        return chat_prompt_ids(ctx.chat_template, ctx.tokenizer, turns, tools, add_generation_prompt,
                               ctx.allow_special_tokens_in_content, template_kwargs, continue_final_message)

    if refuse_past_context:
        await _refuse_text_past_context(ctx, [m["content"] for m in turns if isinstance(m.get("content"), str)],
                                        "messages")
    try:
        return await asyncio.to_thread(render)
    except ValueError as exc:  # template errors, sandbox refusals and message checks
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None


async def create_chat_completion(ctx: ServerContext, http: HTTPRequest, body: bytes) -> Response:
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    req.check()
    lora = check_model(ctx, req.model)
    check_biased_ids(ctx, req)
    tool_names = tool_names_of(req)
    # the template sees the tools even under tool_choice "none"
    prompt = await render_chat(ctx, req.messages, req.tools or None, req.add_generation_prompt,
                               req.chat_template_kwargs, refuse_past_context=req.truncate_prompt_tokens is None,
                               continue_final_message=req.continue_final_message)
    (prompt,) = req.truncated([prompt])
    budget = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_for(ctx, [prompt], req.requested_max_tokens, None, "messages", budget)
    spec, param = chat_constraint(ctx, req)
    await precompile(ctx, spec, param)
    params = chat_sampling_params(ctx, req, max_tokens, req.num_logprobs(), spec, tool_names)
    gen = Generation(ctx, [prompt], params, lora, priority=check_priority(ctx, req.priority))
    gen.reserve()
    if req.stream:
        return StreamingResponse(_chat_stream(gen, req, tool_names), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        (output,) = await gen.final_outputs(http)
    except asyncio.CancelledError:
        return Response(status_code=499)
    choices = [chat_choice(ctx, c, tool_names, max_tool_calls(req)) for c in output.outputs]
    return JSONResponse({"id": f"chatcmpl-{gen.id}", "object": "chat.completion", "created": gen.created,
                         "model": gen.model_name, "choices": choices, "usage": usage(gen.prompts, [output])})


def chat_sampling_params(ctx: ServerContext, req: ChatCompletionRequest, max_tokens: int, num_logprobs: int | None,
                         spec: Any, tool_names: Mapping[str, Any] | None) -> SamplingParams:
    """The request's SamplingParams; a reply read for tool calls keeps the special tokens its parser reads."""
    params = req.sampling_params(ctx.defaults, max_tokens, num_logprobs, spec)
    reads_special = tool_names is not None and ctx.tool_call_parser in READS_SPECIAL_TOKENS
    if reads_special or ctx.reasoning_parser == HARMONY_PARSER:
        # the parser reads the model's markers (<|python_tag|>, [TOOL_CALLS], harmony's <|channel|>): special tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def tool_names_of(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The tools the model may call, by name (to their parameters schemas, which the glm45 parser reads values by),
    or None when tool calling is off for this request."""
    try:
        mode = check_tool_choice(req.tools, req.tool_choice)
    except ValueError as exc:
        param = "tool_choice" if str(exc).startswith("tool_choice") else "tools"
        raise APIError(400, str(exc), param=param) from None
    if mode in (None, "none") or not req.tools:
        return None
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools}


def chat_constraint(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[Any, str | None]:
    """response_format / guided_* or, for tool_choice "required" or a named function, the tool-call grammar;
    under a reasoning parser it applies after the reply's think block (unless the server constrains that too)."""
    spec, param = from_request(req)
    forced = tool_call_constraint(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_call_parser,
                                  ctx.tokenizer) if req.tools else None
    if forced is not None and spec is not None:
        raise APIError(400, f"tool_choice forces a tool call, which {param} would constrain too; send one of them",
                       param="tool_choice", code="invalid_structured_output")
    if forced is not None:
        spec, param = forced, "tool_choice"
    if spec is not None and ctx.reasoning_parser == HARMONY_PARSER:
        raise APIError(400, f"{param} is not supported under --reasoning-parser {HARMONY_PARSER}: a constraint would "
                       "have to hold on the harmony reply's final channel only, which flashllm does not do",
                       param=param, code="invalid_structured_output")
    if spec is not None and ctx.reasoning_parser is not None and not ctx.structured_output_in_reasoning:
        spec = dataclasses.replace(spec, reasoning_parser=ctx.reasoning_parser)
    return spec, param


def max_tool_calls(req: ChatCompletionRequest) -> int:
    return MAX_TOOL_CALLS if req.parallel_tool_calls else 1


def chat_choice(ctx: ServerContext, c: Any, tool_names: Mapping[str, Any] | None, max_calls: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if ctx.reasoning_parser is not None:
        message["reasoning_content"], message["content"] = split_reasoning(ctx.reasoning_parser, c.text)
    finish = c.finish_reason
    if tool_names is not None:
        parsed = parse_reply(ctx.tool_call_parser, message["content"], tool_names, max_calls)
        if parsed.tool_calls:
            message["content"] = parsed.content
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            finish = "tool_calls" if finish == "stop" else finish
    return {"index": c.index, "message": message, "finish_reason": finish,
            "logprobs": chat_logprobs(ctx.tokenizer, c, 0, len(c.token_ids))}


async def _chat_stream(gen: Generation, req: ChatCompletionRequest, tool_names: Mapping[str, Any] | None
                       ) -> AsyncIterator[bytes]:
    ctx = gen.ctx
    head = {"id": f"chatcmpl-{gen.id}", "object": "chat.completion.chunk", "created": gen.created,
            "model": gen.model_name}
    sent: dict[int, int] = {}
    parsers = {i: stream_parser(ctx.tool_call_parser, tool_names, max_tool_calls(req)) for i in range(req.n)} \
        if tool_names is not None else {}
    splitters = {i: reasoning_splitter(ctx.reasoning_parser) for i in range(req.n)} \
        if ctx.reasoning_parser is not None else {}
    num_calls: dict[int, int] = {}
    done: set[int] = set()
    final: RequestOutput | None = None
    so_far: dict[str, Any] = {}  # continuous usage stats: the usage of the newest output, on every chunk

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}], **so_far})

    try:
        if req.continuous_usage:
            so_far = {"usage": usage(gen.prompts, [])}
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for _, output in gen.stream():
            if req.continuous_usage:
                so_far = {"usage": usage(gen.prompts, [output])}
            for c in output.outputs:
                if c.index in done:
                    continue  # a finished choice is repeated in every later output of its request
                done.update([c.index] if c.finished else [])
                start, end = sent.get(c.index, 0), len(c.token_ids)
                sent[c.index] = end
                logprobs = chat_logprobs(ctx.tokenizer, c, start, end)
                reasoning, text = split_delta(splitters.get(c.index), c.delta, c.finished)
                parser = parsers.get(c.index)
                deltas = reasoning + (tool_deltas(parser, text, c.finished, num_calls, c.index) if parser
                                      else ([{"content": text}] if text else []))
                for delta in deltas or ([{}] if logprobs and logprobs["content"] else []):
                    yield chunk(c.index, delta, logprobs=logprobs)
                    logprobs = None
                if c.finished:
                    finish = "tool_calls" if num_calls.get(c.index) and c.finish_reason == "stop" else c.finish_reason
                    yield chunk(c.index, {}, finish)
            final = output if output.finished else final
    except APIError as err:
        yield sse(err.body())
        return
    if req.include_usage and final is not None:
        yield sse({**head, "choices": [], "usage": usage(gen.prompts, [final])})
    yield sse("[DONE]")


def split_delta(splitter: ReasoningSplitter | HarmonySplitter | None, text: str,
                finished: bool) -> tuple[list[dict[str, Any]], str]:
    """(the reasoning_content delta, the content text) of one streamed piece (all content without a splitter);
    a reply's reasoning always comes before its content, so the delta goes first."""
    if splitter is None:
        return [], text
    reasoning, content = splitter.take(text, finished)
    return ([{"reasoning_content": reasoning}] if reasoning else []), content


def tool_deltas(parser: Any, text: str, finished: bool, num_calls: dict[int, int],
                 index: int) -> list[dict[str, Any]]:
    events = parser.feed(text) if text else []
    if finished:
        events += parser.flush()
    deltas: list[dict[str, Any]] = []
    for event in events:
        if event.tool_call is None:
            if event.content:
                deltas.append({"content": event.content})
            continue
        k = num_calls.get(index, 0)
        num_calls[index] = k + 1
        deltas.append({"tool_calls": [{"index": k, **event.tool_call.to_openai()}]})
    return deltas
