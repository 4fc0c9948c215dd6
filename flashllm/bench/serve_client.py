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
    """Timings of one request in seconds; `itl` holds every gap between streamed text chunks."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


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


def _carries_output(chunk: dict[str, Any], endpoint: str) -> bool:
    """Whether a chunk reports generated tokens: text, or (completions) a mid-stream chunk whose
    tokens decode to no text, as random-weight models with a small tokenizer produce."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    if endpoint == "chat":
        return bool((choices[0].get("delta") or {}).get("content"))
    return bool(choices[0].get("text")) or choices[0].get("finish_reason") is None


async def send_request(client: httpx.AsyncClient, target: ServeTarget, request: ServeRequest) -> RequestResult:
    """POST one streaming request and time the arrival of every chunk that carries output."""
    result = RequestResult(prompt_len=request.prompt_len)
    url = f"{target.url.rstrip('/')}{ENDPOINTS[target.endpoint]}"
    chunks, usage, done = 0, None, False
    start = last = time.perf_counter()
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
                if _carries_output(chunk, target.endpoint):
                    now = time.perf_counter()
                    if chunks:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - start
                    chunks, last = chunks + 1, now
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    if not done:
        result.error = "the stream ended without data: [DONE]"
    elif not chunks:
        result.error = "the stream carried no generated output"
    else:
        result.success = True
        result.output_tokens = int(usage["completion_tokens"]) if usage else chunks
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
