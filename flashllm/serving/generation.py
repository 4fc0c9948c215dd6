"""From a validated request to engine sub-requests and back: fan-out, timeouts, disconnects, logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from flashllm.outputs import CompletionOutput, RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.serving.async_engine import AsyncEngine, CutOff, Draining, EngineDead, ServerBusy
from flashllm.serving.metrics import ServerMetrics
from flashllm.serving.protocol import APIError

RETRY_AFTER_S = 1


@dataclass
class ServerContext:
    """What the API handlers share: the engine, its tokenizer and the serving limits."""

    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    defaults: dict[str, Any]
    request_timeout: float
    metrics: ServerMetrics
    chat_template: Any = None
    vocab_size: int | None = None  # prompt token ids must be below it; None: the engine checks
    model_info: dict[str, Any] = field(default_factory=dict)  # extra /v1/models fields (e.g. static mode's)
    # trusted callers only: special-token spellings in chat message content become control tokens
    allow_special_tokens_in_content: bool = False
    # multi-LoRA (serving/lora_api.py): adapter name -> LoRARequest, selected by the request's `model`
    loras: dict[str, Any] = field(default_factory=dict)
    model_aliases: tuple[str, ...] = ()  # further --served-model-name values, accepted as model_name
    reasoning_parser: str | None = None  # serving/reasoning.py: <think> text answered as reasoning_content
    # with a reasoning parser: structured output constrains the think block too (else only what follows it)
    structured_output_in_reasoning: bool = False
    scheduling_policy: str = "fcfs"  # "priority": requests' `priority` orders admission and preemption
    tool_call_parser: str = "hermes"  # serving/tool_parsers.py: how the model writes tool calls
    # /v1/embeddings: the model directory's pooling (None: pooling_error says why it cannot embed), and the
    # hidden size that bounds a request's `dimensions`
    pooling: Any = None
    pooling_error: str = "it has no pooling configuration"
    embedding_size: int | None = None
    response_store: Any = None  # /v1/responses' stored responses (serving/responses_api.py), made at first use


@dataclass
class Generation:
    """One API request fanned out into engine requests (one per prompt; each has `n` sequences)."""

    ctx: ServerContext
    prompts: list[list[int]]
    params: SamplingParams
    lora_request: Any = None  # the adapter the request's `model` named (None: the base model)
    priority: int = 0  # serve --scheduling-policy priority: lower runs first
    request_ids: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    aborted: str | None = field(default=None, init=False)  # why it ended early, counted once in /metrics

    @property
    def model_name(self) -> str:
        """The `model` answers name: the adapter's name, or the served model's."""
        return self.ctx.model_name if self.lora_request is None else self.lora_request.lora_name

    def reserve(self) -> None:
        """Claim engine seats; 503 (busy, draining, engine failed) before anything is sent."""
        self.request_ids = [f"{self.id}-{i}" for i in range(len(self.prompts))]
        capacity = self.ctx.engine.capacity
        if len(self.request_ids) > capacity:
            # Never admissible: a 503 with Retry-After would have clients retry forever.
            raise APIError(400, f"the request has {len(self.request_ids)} prompts but this server admits at most "
                           f"{capacity} at once (--max-num-seqs + --max-queue); send fewer prompts per request",
                           param="prompt", code="too_many_prompts")
        try:
            self.ctx.engine.reserve(self.request_ids)
        except ServerBusy as exc:
            self.ctx.metrics.reject("queue_full")
            raise APIError(503, f"the server is at capacity ({exc}); retry later", "server_busy",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Draining:
            self.ctx.metrics.reject("draining")
            raise APIError(503, "the server is shutting down", "server_unavailable", code="draining",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDead as exc:
            self.ctx.metrics.reject("engine_dead")
            raise APIError(503, str(exc), "server_unavailable", code="engine_dead") from None

    def release(self) -> None:
        for request_id in self.request_ids:
            self.ctx.engine.release(request_id)

    def abort(self, reason: str) -> None:
        """Record why this request ended early (once, however many paths notice it)."""
        if self.aborted is None:
            self.aborted = reason
            self.ctx.metrics.abort(reason)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as each engine step produces them, until all finish or a timeout.

        Raises APIError 408 after `request_timeout` seconds. Leaving early aborts everything.
        """
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, request_id: str) -> None:
            try:
                async for output in self.ctx.engine.generate(request_id, self.prompts[index], self.params,
                                                             self.lora_request, self.priority):
                    await queue.put((index, output))
                await queue.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(self.request_ids)]
        last_time = time.monotonic()
        try:
            async with asyncio.timeout(self.ctx.request_timeout):
                remaining = len(tasks)
                while remaining:
                    item = await queue.get()
                    if item is None:
                        remaining -= 1
                        continue
                    if isinstance(item, EngineDead):
                        raise APIError(503, str(item), "server_unavailable", code="engine_dead")
                    if isinstance(item, CutOff):
                        self.abort("shutdown")
                        raise APIError(503, str(item), "server_unavailable", code="shutdown",
                                       headers={"Retry-After": str(RETRY_AFTER_S)})
                    if isinstance(item, BaseException):
                        raise item
                    now = time.monotonic()
                    self.ctx.metrics.inter_token(now - last_time)
                    last_time = now
                    if item[1].finished:
                        self.ctx.metrics.finish(item[1])
                    yield item
        except TimeoutError:
            self.abort("timeout")
            raise APIError(408, f"the request did not finish within {self.ctx.request_timeout:g} s "
                           "(--request-timeout)", "timeout_error", code="request_timeout") from None
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away mid-stream: a streaming client disconnected (Starlette cancels
            # the response) or final_outputs gave up on a disconnected client.
            self.abort("client_disconnect")
            raise
        finally:
            for task in tasks:
                task.cancel()
            self.release()

    async def final_outputs(self, http: HTTPRequest) -> list[RequestOutput]:
        """Run to completion; a client that disconnects first aborts the whole request."""
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for index, output in self.stream():
                if output.finished:
                    finals[index] = output

        collector = asyncio.create_task(collect())
        watcher = asyncio.create_task(_wait_disconnect(http))
        try:
            done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                self.abort("client_disconnect")
                collector.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collector
        if collector not in done:
            raise asyncio.CancelledError("client disconnected")
        collector.result()
        return [finals[i] for i in range(len(self.prompts))]


async def _wait_disconnect(http: HTTPRequest) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def usage(prompts: list[list[int]], outputs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


# JSON has no -Infinity: a token a grammar or a bias ruled out (logprob -inf) is sent at this floor, as
# vLLM sends it, so a top_logprobs list keeps its length and the body stays valid JSON
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (and NaN, which no distribution gives) at LOGPROB_FLOOR."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(tokenizer: Any, completion: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
    """OpenAI chat `logprobs.content` entries for tokens [start, end) of a completion."""
    if completion.logprobs is None:
        return None
    entries = []
    for i in range(start, min(end, len(completion.logprobs))):
        text = token_text(tokenizer, completion.token_ids[i])
        tops = completion.top_logprobs[i] if completion.top_logprobs else []
        entries.append({
            "token": text, "logprob": json_logprob(completion.logprobs[i]), "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := token_text(tokenizer, tid)), "logprob": json_logprob(lp),
                              "bytes": list(t.encode())}
                             for tid, lp in tops],
        })
    return {"content": entries}


def echo_logprobs(tokenizer: Any, output: RequestOutput) -> dict[str, Any]:
    """Legacy completions `logprobs` of the prompt tokens (echo): the first token has none (null)."""
    tokens, offsets, tops, chosen, offset = [], [], [], [], 0
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    for token_id, entry in zip(output.prompt_token_ids, entries, strict=True):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        chosen.append(None if entry is None else json_logprob(entry[0]))
        tops.append(None if entry is None else {token_text(tokenizer, tid): json_logprob(lp) for tid, lp in entry[1]})
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy `logprobs` objects one after the other (the prompt's, then the completion's)."""
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_logprobs(tokenizer: Any, completion: CompletionOutput, start: int, end: int,
                        text_offset: int) -> dict[str, Any] | None:
    """Legacy completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) for [start, end)."""
    if completion.logprobs is None:
        return None
    tokens, offsets, tops = [], [], []
    for i in range(start, min(end, len(completion.logprobs))):
        text = token_text(tokenizer, completion.token_ids[i])
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        pairs = completion.top_logprobs[i] if completion.top_logprobs else []
        tops.append({token_text(tokenizer, tid): json_logprob(lp) for tid, lp in pairs})
    return {"tokens": tokens, "token_logprobs": [json_logprob(lp) for lp in completion.logprobs[start:end]],
            "top_logprobs": tops, "text_offset": offsets}
