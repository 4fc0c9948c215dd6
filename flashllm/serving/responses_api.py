"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat completions machinery.

A request's `instructions` and `input` items (messages, function calls and their outputs) become chat messages,
its function tools and `text.format` the chat request's tools and response_format; the reply runs exactly as
/v1/chat/completions runs it (chat template, tool-call parser, reasoning parser, structured output) and comes
back as Responses output items: a `reasoning` item, `function_call` items and a `message` with `output_text`.
`previous_response_id` continues a stored response's conversation; responses are stored (unless `store` is
false) in a bounded in-process store, newest kept, so a restart forgets them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from flashllm.serving.generation import Generation, ServerContext, usage
from flashllm.serving.openai_api import (
    SSE_HEADERS,
    chat_choice,
    chat_constraint,
    chat_sampling_params,
    check_biased_ids,
    check_model,
    check_priority,
    max_tokens_for,
    max_tool_calls,
    render_chat,
    split_delta,
    tool_deltas,
    tool_names_of,
)
from flashllm.serving.protocol import (
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_SEED,
    MAX_TEXT_CHARS,
    MAX_TOKENS_LIMIT,
    APIError,
    ChatCompletionRequest,
    RequestModel,
    parse_body,
    validation_error,
)
from flashllm.serving.reasoning import reasoning_splitter
from flashllm.serving.structured import precompile
from flashllm.serving.tool_parsers import stream_parser

# The store's bound: the newest responses whose conversations hold at most this many characters in all.
STORE_MAX_CHARS = 64 << 20
MAX_METADATA = 16  # OpenAI's limit: 16 key-value pairs, keys up to 64 and values up to 512 characters


class ResponsesRequest(RequestModel):
    """POST /v1/responses: the fields flashllm reads (others, such as `include` or `service_tier`, are ignored)."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # vLLM's extra
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # accepted; a model reasons as its template and --reasoning-parser say
    previous_response_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA)
    truncation: Literal["disabled"] = "disabled"
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    priority: int = 0


class ResponseStore:
    """Finished responses by id, with the conversation each continues from (chat messages: its input and its
    reply), newest kept within STORE_MAX_CHARS characters of conversation."""

    def __init__(self, max_chars: int = STORE_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self._items: collections.OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = \
            collections.OrderedDict()
        self._chars = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(conversation)) + len(json.dumps(response))
        if size > self.max_chars:
            return  # larger than the whole store: kept nowhere, as if store were false
        self._items[response["id"]] = (response, conversation, size)
        self._chars += size
        while self._chars > self.max_chars:
            _, (_, _, dropped) = self._items.popitem(last=False)
            self._chars -= dropped

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        item = self._items.get(response_id)
        return None if item is None else item[:2]

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is not None:
            self._chars -= item[2]
        return item is not None


def _store(ctx: ServerContext) -> ResponseStore:
    if ctx.response_store is None:
        ctx.response_store = ResponseStore()
    return ctx.response_store


def _text_of(content: Any, where: str) -> str:
    """A message item's content as text: a string, or its text parts joined (anything else is refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content holds a {kind or 'non-object'} part; flashllm reads text parts "
                           "(input_text, output_text) only", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages: message items as they are, a function call joined to the assistant
    message before it (or a new one), a function call's output as a tool message; reasoning items dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _string(item, "output", where)})
        elif kind != "reasoning":
            raise APIError(400, f"{where}.type {kind!r} is not supported; flashllm reads message, function_call, "
                           "function_call_output and reasoning items", param="input")
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param="input")
    return value


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({type, name, description, parameters, strict}) in the chat form."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type {tool.get('type')!r} is not supported; flashllm runs function "
                           "tools only", param="tools")
        converted.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                                 "strict") if k in tool}})
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format ({type: text | json_object | json_schema, name, schema, strict}) as chat's response_format."""
    form = (text or {}).get("format")
    if form is None:
        return None
    if not isinstance(form, dict):
        raise APIError(400, "text.format must be an object", param="text")
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: form[k] for k in ("name", "description", "schema", "strict")
                                                       if k in form}}
    return {"type": form.get("type")}


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "tools": _chat_tools(req.tools),
            "tool_choice": _chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text), "priority": req.priority}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=False)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Reply:
    """The output items of one reply in the order they came: its reasoning, its message, its function calls."""

    def __init__(self) -> None:
        self.reasoning = ""
        self.text = ""
        self.calls: list[dict[str, Any]] = []
        self.order: list[str | dict[str, Any]] = []  # "reasoning", "message" or a function_call item
        self.reasoning_id, self.message_id = _new_id("rs"), _new_id("msg")

    def open(self, which: str | dict[str, Any]) -> int:
        """Add an item ("reasoning", "message" or a function call's item) after the others; its output index."""
        self.order.append(which)
        if isinstance(which, dict):
            self.calls.append(which)
        return len(self.order) - 1

    def reasoning_item(self, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": self.reasoning}]}

    def text_part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def message_item(self, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.text_part()] if status == "completed" else []}

    def items(self) -> list[dict[str, Any]]:
        made = {"reasoning": self.reasoning_item, "message": self.message_item}
        return [which if isinstance(which, dict) else made[which]() for which in self.order]

    def assistant_message(self) -> dict[str, Any]:
        """The reply as the chat message a later turn's conversation holds."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return message


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a function_call output item."""
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


class _Call:
    """One /v1/responses request, resolved: its chat request, conversation, prompt and generation."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, conversation: list[dict[str, Any]],
                 chat: ChatCompletionRequest, gen: Generation, tool_names: Mapping[str, Any] | None) -> None:
        self.ctx, self.req, self.conversation, self.chat, self.gen = ctx, req, conversation, chat, gen
        self.tool_names = tool_names
        self.id, self.created = _new_id("resp"), int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], final: Any = None) -> dict[str, Any]:
        req, finish = self.req, final.outputs[0].finish_reason if final is not None else None
        incomplete = status == "completed" and finish == "length"
        used = usage(self.gen.prompts, [final] if final is not None else [])
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": "incomplete" if incomplete else status, "model": self.gen.model_name, "output": output,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls, "text": req.text or {"format": {"type": "text"}},
            "reasoning": req.reasoning, "previous_response_id": req.previous_response_id, "store": req.store,
            "metadata": req.metadata or {}, "truncation": req.truncation, "user": req.user,
            "usage": {"input_tokens": used["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": used["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": used["total_tokens"]},
        }

    def finish(self, reply: _Reply, final: Any) -> dict[str, Any]:
        response = self.response("completed", reply.items(), final)
        if self.req.store:
            _store(self.ctx).put(response, self.conversation + [reply.assistant_message()])
        return response


async def create_response(ctx: ServerContext, http: HTTPRequest, body: bytes) -> Response:
    req: ResponsesRequest = parse_body(ResponsesRequest, body)
    lora = check_model(ctx, req.model)
    conversation: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = _store(ctx).get(req.previous_response_id)
        if stored is None:
            raise APIError(404, f"no stored response {req.previous_response_id!r} (responses are kept in this "
                           "server's memory, newest first, unless sent with store: false)", "not_found_error",
                           param="previous_response_id", code="response_not_found")
        conversation = list(stored[1])
    conversation += _messages(req.input)
    head = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat = _chat_request(req, head + conversation)
    chat.check()
    check_biased_ids(ctx, chat)
    tool_names = tool_names_of(chat)
    prompt = await render_chat(ctx, chat.messages, chat.tools or None, True)
    max_tokens = max_tokens_for(ctx, [prompt], chat.requested_max_tokens, None, "input", "max_output_tokens")
    spec, param = chat_constraint(ctx, chat)
    await precompile(ctx, spec, param)
    params = chat_sampling_params(ctx, chat, max_tokens, None, spec, tool_names)
    gen = Generation(ctx, [prompt], params, lora, priority=check_priority(ctx, chat.priority))
    gen.reserve()
    call = _Call(ctx, req, conversation, chat, gen, tool_names)
    if req.stream:
        return StreamingResponse(_stream(call), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        (output,) = await gen.final_outputs(http)
    except asyncio.CancelledError:
        return Response(status_code=499)
    message = chat_choice(ctx, output.outputs[0], tool_names, max_tool_calls(chat))["message"]
    reply = _Reply()
    reply.reasoning, reply.text = message.get("reasoning_content") or "", message["content"] or ""
    if reply.reasoning:
        reply.open("reasoning")
    if reply.text or not message.get("tool_calls"):
        reply.open("message")
    for tool_call in message.get("tool_calls", []):
        reply.open(_call_item(tool_call))
    return JSONResponse(call.finish(reply, output))


class _Events:
    """The Responses stream's server-sent events for one reply, numbered in order, and the items they build."""

    def __init__(self) -> None:
        self.reply = _Reply()
        self.sequence = 0
        self.streaming: dict[str, int] = {}  # "reasoning" / "message" -> its output index while its deltas stream

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def start(self, which: str) -> list[bytes]:
        """An item ("reasoning" or "message") added, unless its deltas already stream."""
        if which in self.streaming:
            return []
        reply, index = self.reply, self.reply.open(which)
        self.streaming[which] = index
        if which == "reasoning":
            return [self.event("response.output_item.added", output_index=index,
                               item=reply.reasoning_item("in_progress"))]
        return [self.event("response.output_item.added", output_index=index, item=reply.message_item("in_progress")),
                self.event("response.content_part.added", item_id=reply.message_id, output_index=index,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                  "logprobs": []})]

    def end(self, which: str) -> list[bytes]:
        """A streaming item's done events (none when it is not streaming)."""
        index, reply = self.streaming.pop(which, None), self.reply
        if index is None:
            return []
        if which == "reasoning":
            return [self.event("response.reasoning_text.done", item_id=reply.reasoning_id, output_index=index,
                               content_index=0, text=reply.reasoning),
                    self.event("response.output_item.done", output_index=index, item=reply.reasoning_item())]
        return [self.event("response.output_text.done", item_id=reply.message_id, output_index=index,
                           content_index=0, text=reply.text, logprobs=[]),
                self.event("response.content_part.done", item_id=reply.message_id, output_index=index,
                           content_index=0, part=reply.text_part()),
                self.event("response.output_item.done", output_index=index, item=reply.message_item())]

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        """One chat delta (reasoning_content, content or whole tool calls) as Responses events."""
        reply, events = self.reply, []
        if delta.get("reasoning_content"):
            events += self.start("reasoning")
            reply.reasoning += delta["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", item_id=reply.reasoning_id,
                                     output_index=self.streaming["reasoning"], content_index=0,
                                     delta=delta["reasoning_content"]))
        if delta.get("content"):
            events += self.end("reasoning") + self.start("message")
            reply.text += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=reply.message_id,
                                     output_index=self.streaming["message"], content_index=0, delta=delta["content"],
                                     logprobs=[]))
        for tool_call in delta.get("tool_calls", []):
            events += self.end("reasoning") + self.function_call(tool_call)
        return events

    def function_call(self, tool_call: dict[str, Any]) -> list[bytes]:
        """A whole function call (the parsers hand calls over whole): added, its arguments, done."""
        item = _call_item(tool_call)
        index = self.reply.open(item)
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def close(self) -> list[bytes]:
        """The open items' done events; an empty message where the reply had neither text nor calls."""
        empty = not self.reply.calls and "message" not in self.reply.order
        return self.end("reasoning") + (self.start("message") if empty else []) + self.end("message")


async def _stream(call: _Call) -> AsyncIterator[bytes]:
    """The reply as Responses events: response.created and .in_progress, each output item added, its deltas and
    done events (reasoning text, output text, function call arguments), then response.completed (or .incomplete)."""
    ctx, events = call.ctx, _Events()
    parser = stream_parser(ctx.tool_call_parser, call.tool_names, max_tool_calls(call.chat)) \
        if call.tool_names is not None else None
    splitter = reasoning_splitter(ctx.reasoning_parser) if ctx.reasoning_parser is not None else None
    yield events.event("response.created", response=call.response("in_progress", []))
    yield events.event("response.in_progress", response=call.response("in_progress", []))
    final = None
    try:
        async for _, output in call.gen.stream():
            c = output.outputs[0]
            reasoning, text = split_delta(splitter, c.delta, c.finished)
            deltas = reasoning + (tool_deltas(parser, text, c.finished, {}, 0) if parser
                                  else ([{"content": text}] if text else []))
            for chunk in [chunk for delta in deltas for chunk in events.delta(delta)]:
                yield chunk
            final = output if output.finished else final
    except APIError as err:
        yield events.event("error", code=err.code or err.type, message=err.message, param=err.param)
        return
    for chunk in events.close():
        yield chunk
    response = call.finish(events.reply, final)
    yield events.event(f"response.{response['status']}", response=response)


async def retrieve_response(ctx: ServerContext, response_id: str) -> Response:
    stored = _store(ctx).get(response_id)
    if stored is None:
        raise _not_stored(response_id)
    return JSONResponse(stored[0])


async def delete_response(ctx: ServerContext, response_id: str) -> Response:
    if not _store(ctx).delete(response_id):
        raise _not_stored(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id[:100]!r}", "not_found_error", code="response_not_found")
