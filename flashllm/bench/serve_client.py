"""Load an OpenAI-compatible server with Poisson arrivals and time every streamed token."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One benchmark request: a text prompt (or token ids, completions only) and max_tokens."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class RequestResult:
    """Timings of one request in seconds from its send.

    token_times[i]: arrival of the streamed chunk that carried output token i. A chunk carries one
    token unless it says otherwise (its logprobs list); where the server packs several tokens into
    a chunk without saying so (usage counts more tokens than were stamped), `per_token` is False
    and token_times holds one stamp per chunk.
    """

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    e2e: float = 0.0
    token_times: list[float] = field(default_factory=list)
    per_token: bool = True
    error: str = ""

    @property
    def ttft(self) -> float:
        """Seconds from the send to the first output token (0.0 when none came)."""
        return self.token_times[0] if self.token_times else 0.0

    @property
    def itl(self) -> list[float]:
        """Every gap between consecutive token stamps (0.0 for tokens that came in the same chunk)."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, from the arrival of the first and the last token:
        (t_last - t_first) / (output_tokens - 1); the tail after the last token is not counted."""
        if not self.success or self.output_tokens < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class ServeTarget:
    """Where and how to send: the API root (`http://HOST:PORT/v1`), model name, endpoint, key."""

    url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start, shape (num,), first at 0.

    Gaps are i.i.d. exponential with mean 1/rate (a Poisson process of `rate` requests/s) drawn
    from a generator seeded with `seed`; rate = inf sends everything at once (all offsets 0).
    """
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def fetch_model_name(url: str, api_key: str | None = None) -> str:
    """The first model id listed by `GET {url}/models`."""
    headers = ServeTarget(url, "", api_key=api_key).headers()
    response = httpx.get(f"{url.rstrip('/')}/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/models lists no model; pass --model NAME")
    return str(models[0]["id"])


def request_body(target: ServeTarget, request: ServeRequest) -> dict[str, Any]:
    """The streaming JSON body: greedy, EOS ignored, exactly `output_len` new tokens, usage at the end."""
    body: dict[str, Any] = {
        "model": target.model, "max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, got token ids; use --endpoint completions")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def chunk_tokens(chunk: dict[str, Any], endpoint: str) -> int:
    """Output tokens a streamed chunk carries: 0 for one without output (a role-only delta, the
    closing chunk with only finish_reason, the usage chunk), the length of its logprobs list where
    it has one, else 1. A completions chunk whose text is empty mid-stream is a token that decoded
    to no text, as random-weight models with a small tokenizer produce."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if endpoint == "chat":
        if not (choice.get("delta") or {}).get("content"):
            return 0
        listed = (choice.get("logprobs") or {}).get("content")
    else:
        if not choice.get("text") and choice.get("finish_reason") is not None:
            return 0
        listed = (choice.get("logprobs") or {}).get("tokens")
    return len(listed) if isinstance(listed, list) and listed else 1


async def send_request(client: httpx.AsyncClient, target: ServeTarget, request: ServeRequest) -> RequestResult:
    """POST one streaming request and stamp every output token with the arrival of its chunk."""
    result = RequestResult(prompt_len=request.prompt_len)
    url = f"{target.url.rstrip('/')}{ENDPOINTS[target.endpoint]}"
    usage, done = None, False
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=request_body(target, request), headers=target.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:500]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"error in stream: {chunk['error']}"
                    return result
                usage = chunk.get("usage") or usage
                tokens = chunk_tokens(chunk, target.endpoint)
                if tokens:
                    result.token_times += [time.perf_counter() - start] * tokens
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    if not done:
        result.error = "the stream ended without data: [DONE]"
    elif not result.token_times:
        result.error = "the stream carried no generated output"
    else:
        result.success = True
        result.output_tokens = int(usage["completion_tokens"]) if usage else len(result.token_times)
        result.per_token = result.output_tokens == len(result.token_times)
        if usage and usage.get("prompt_tokens"):
            result.prompt_len = int(usage["prompt_tokens"])
    return result


async def run_benchmark(target: ServeTarget, requests: Sequence[ServeRequest], request_rate: float = math.inf,
                        max_concurrency: int | None = None, seed: int = 0,
                        progress: bool = True, transport: httpx.AsyncBaseTransport | None = None,
                        ) -> tuple[list[RequestResult], float]:
    """Send `requests` at Poisson arrival times, at most `max_concurrency` in flight.

    `transport` replaces the network (tests pass an httpx.MockTransport). Returns the per-request results (in request order) and the wall time in seconds from the
    first send to the last completion.
    """
    from tqdm import tqdm

    offsets = poisson_arrivals(len(requests), request_rate, seed)
    limit = max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        start = time.perf_counter()

        async def one(offset: float, request: ServeRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with semaphore:
                result = await send_request(client, target, request)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests, strict=True)))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration
