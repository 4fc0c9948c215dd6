"""Sustained mixed load with every core busy elsewhere: the promises of RELIABILITY.md hold throughout.

The server runs issue 40's stall configuration (--max-num-seqs 8 --max-queue 4 --request-timeout 3,
where bursts of 16 used to time out together under contention). For FLASHLLM_STRESS_SECONDS (60)
it gets bursts of 16, streams cut after their first event, oversized bodies, slow clients past
the body timeout and slow ones within it, while a canary client and a /health prober measure
latency. Latency bounds are relative: the canary's p99 against its own p99 on the idle server
under the same contention, the fast answers against the calibrated slowdown.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from flashllm.testing.server import ServerProcess, running_server
from flashllm.testing.timing import time_limit

SECONDS = float(os.environ.get("FLASHLLM_STRESS_SECONDS", "60"))
FLAGS = ["--max-model-len", "128", "--block-size", "16", "--num-kv-blocks", "64", "--max-num-seqs", "8",
         "--max-queue", "4", "--request-timeout", "3", "--body-timeout", "2", "--max-body-bytes", "65536"]
CANARY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
BURST = 16
# The canary waits behind at most a full batch and queue of short requests while this process's own
# clients (and, on a shared 2-vCPU VM, other people's work) share the busy cores: its p99
# under load may be this many times its p99 alone, both with every core busy. Measured there:
# 18x, 37x and 80x (0.5-2.2 s against ~0.027 s) in three 20 s runs at load averages of 6-10; the
# stall of issue 40 timed every request out (3 s, --request-timeout).
CANARY_FACTOR = 100.0
REQUEST_TIMEOUT_S = 3.0
FAST_S = 0.5  # 503s, on the idle team VM (scaled by time_limit)
# /health shares the event loop with everything else and the prober shares the cores with the load:
# its p99 within this multiple of FAST_S (scaled); its slowest seen was 1.3 s.
HEALTH_FACTOR = 4.0


@pytest.fixture(scope="module")
def busy_cores() -> Iterator[None]:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for proc in loops:
            proc.kill()
        for proc in loops:
            proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # The built-in demo model, not a tiny test model: its products are large enough for the native
    # kernels to split them over the worker pool, which is where the stall was.
    with running_server(FLAGS) as server:
        httpx.post(f"{server.url}/completions", json=CANARY, timeout=60)  # warm-up
        yield server


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else max(values)


async def _canary(client: httpx.AsyncClient, url: str, latencies: list[float], statuses: Counter[int]) -> str:
    started = time.monotonic()
    reply = await client.post(f"{url}/completions", json=CANARY)
    statuses[reply.status_code] += 1
    if reply.status_code == 200:
        latencies.append(time.monotonic() - started)
        return str(reply.json()["choices"][0]["text"])
    return ""


async def _slow_client(port: int, seconds_per_byte: float, body: bytes) -> bytes:
    """Send a head, then the body one byte at a time; returns what the server answered (b"" if nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
    answer = asyncio.create_task(reader.read(65536))  # a 408 arrives while the body is still trickling
    try:
        for i in range(len(body)):
            if answer.done():
                break
            writer.write(body[i:i + 1])
            await writer.drain()
            await asyncio.sleep(seconds_per_byte)
        return await asyncio.wait_for(answer, 10)
    except (ConnectionError, OSError):
        return answer.result() if answer.done() and not answer.exception() else b""
    finally:
        writer.close()


async def _load(server: ServerProcess, seconds: float) -> SimpleNamespace:
    url, until = server.url, time.monotonic() + seconds
    rng = random.Random(40)
    seen = SimpleNamespace(bursts=Counter(), refusal_s=[], canary=[], canary_status=Counter(), texts=set(),
                           health=[], cut=Counter(), oversized=Counter(), slow=Counter())

    async def bursts(client: httpx.AsyncClient) -> None:
        async def one(i: int) -> None:
            started = time.monotonic()
            body = {"prompt": f"burst {i} of the river", "max_tokens": rng.randint(4, 16), "stream": i % 2 == 0}
            reply = await client.post(f"{url}/completions", json=body)
            seen.bursts[reply.status_code] += 1
            if reply.status_code == 503:
                seen.refusal_s.append(time.monotonic() - started)
        while time.monotonic() < until:
            await asyncio.gather(*(one(i) for i in range(BURST)))
            await asyncio.sleep(0.5)

    async def cut_streams(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            async with client.stream("POST", f"{url}/completions",
                                     json={"prompt": "cut me", "max_tokens": 64, "stream": True}) as reply:
                seen.cut[reply.status_code] += 1
                async for _ in reply.aiter_lines():
                    break
            await asyncio.sleep(0.2)

    async def oversized(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            reply = await client.post(f"{url}/completions", content=b"x" * 70000,
                                      headers={"Content-Type": "application/json"})
            seen.oversized[reply.status_code] += 1
            await asyncio.sleep(0.3)

    async def slow_clients() -> None:
        body = b'{"prompt": "slow", "max_tokens": 2}'
        while time.monotonic() < until:
            too_slow, in_time = await asyncio.gather(_slow_client(server.port, 0.5, body),
                                                     _slow_client(server.port, 0.01, body))
            seen.slow[too_slow[9:12].decode() or "closed"] += 1
            seen.slow[in_time[9:12].decode() or "closed"] += 1

    async def canary(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            seen.texts.add(await _canary(client, url, seen.canary, seen.canary_status))
            await asyncio.sleep(0.2)

    async def health(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            assert (await client.get(f"{server.base_url}/health")).status_code == 200
            seen.health.append(time.monotonic() - started)
            await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=30, limits=limits) as a, httpx.AsyncClient(timeout=30) as b:
        await asyncio.gather(bursts(a), cut_streams(a), oversized(a), slow_clients(), canary(b), health(b))
    return seen


@pytest.fixture(scope="module")
def run(server: ServerProcess, busy_cores: None) -> SimpleNamespace:
    async def alone() -> tuple[list[float], str]:
        latencies: list[float] = []
        statuses: Counter[int] = Counter()
        async with httpx.AsyncClient(timeout=30) as client:
            texts = {await _canary(client, server.url, latencies, statuses) for _ in range(15)}
        # with the stall, even a lone request timed out (408) once every core was busy
        assert set(statuses) == {200} and len(texts) == 1, f"the canary alone: {dict(statuses)}"
        return latencies, texts.pop()

    baseline, text = asyncio.run(alone())
    fast_s = time_limit(FAST_S)
    seen = asyncio.run(_load(server, SECONDS))
    # the record of the run (docs/reliability.md quotes it; pytest -rA shows it)
    print(f"{SECONDS:.0f} s: bursts {dict(seen.bursts)}, cut streams {dict(seen.cut)}, oversized "
          f"{dict(seen.oversized)}, slow clients {dict(seen.slow)}, canary {dict(seen.canary_status)} p99 "
          f"{_p99(seen.canary):.3f} s (alone {_p99(baseline):.3f} s), /health p99 {_p99(seen.health):.3f} s "
          f"over {len(seen.health)}, slowest 503 {max(seen.refusal_s, default=0):.3f} s, fast bound {fast_s:.2f} s")
    return SimpleNamespace(baseline=baseline, text=text, fast_s=fast_s, seen=seen, ended=time.monotonic())


def test_bursts_are_served_or_refused_fast_never_timed_out(run: SimpleNamespace) -> None:
    seen = run.seen
    assert set(seen.bursts) <= {200, 503} and seen.bursts[200] > 0, dict(seen.bursts)  # a 408 is the stall
    assert seen.refusal_s and max(seen.refusal_s) < run.fast_s, f"slowest 503 {max(seen.refusal_s):.2f} s"
    assert set(seen.cut) <= {200, 503} and set(seen.oversized) == {413}, (seen.cut, seen.oversized)
    assert seen.slow["408"] > 0 and seen.slow["200"] > 0 and set(seen.slow) <= {"200", "408", "503"}, seen.slow


def test_health_and_the_canary_keep_answering(run: SimpleNamespace) -> None:
    seen = run.seen
    assert _p99(seen.health) < HEALTH_FACTOR * run.fast_s, f"/health p99 {_p99(seen.health):.2f} s"
    assert max(seen.health) < REQUEST_TIMEOUT_S, f"slowest /health {max(seen.health):.2f} s"
    assert set(seen.canary_status) <= {200, 503} and seen.canary_status[200] >= 10, dict(seen.canary_status)
    assert seen.texts - {""} == {run.text}, "the greedy canary changed under load"
    alone, loaded = _p99(run.baseline), _p99(seen.canary)
    assert loaded < min(CANARY_FACTOR * alone, REQUEST_TIMEOUT_S), \
        f"canary p99 {loaded:.3f} s under load, {alone:.3f} s alone"


def test_afterwards_every_block_is_free_and_the_engine_never_stalled(server: ServerProcess, run: SimpleNamespace,
                                                                     ) -> None:
    deadline = time.monotonic() + 2.0
    while True:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("flashllm:") and "{" in line and "reason" not in line}
        if values["flashllm:kv_blocks_free"] == values["flashllm:kv_blocks_total"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert values["flashllm:kv_blocks_free"] == values["flashllm:kv_blocks_total"], values
    assert values["flashllm:num_requests_running"] == values["flashllm:num_requests_waiting"] == 0
    assert values["flashllm:engine_stalls_total"] == 0
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert "Traceback" not in server.log()
