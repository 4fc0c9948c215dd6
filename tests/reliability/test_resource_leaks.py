"""Nothing accumulates per request: file descriptors, threads, KV blocks, engine and Python objects.

The server runs in this process (uvicorn on a loopback port in a thread, with the guarded
connection layer), so the test can look inside it: after rounds of mixed traffic (whole and
streamed replies, streams cut mid-way, requests cancelled while they run, bodies cut off mid-way,
oversized and malformed bodies, bursts past the queue) the second and third rounds must leave
exactly what the first left, and no type of live object may keep growing from round to round.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn

from flashllm.cli import serve as serve_cli
from flashllm.serving.server import BuiltServer, build_server, uvicorn_config
from flashllm.testing.server import free_port

ROUND_REQUESTS = 48
CONCURRENCY = 12
# A type whose live count grows by this much in each of two later rounds keeps something of many
# requests (each round has 10-20 of every outcome); between rounds of a healthy server live counts
# moved by at most 2 (a connection object awaiting collection).
LEAK_LIMIT = 5
SEED = 40


def _options(model_dir: Path) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    # capacity 4 + 2: the bursts below overflow it, so 503s are part of the mix
    args = parser.parse_args(["serve", str(model_dir), "--max-model-len", "128", "--block-size", "16",
                              "--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-queue", "2",
                              "--max-body-bytes", "65536"])
    return serve_cli.resolve_options(args, environ={})


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[SimpleNamespace]:
    """The built server running in a thread of this process; yields it with its base URL."""
    built = build_server(_options(tiny_model_dir))
    port = free_port()
    uv = uvicorn.Server(uvicorn_config(built, "127.0.0.1", port))
    built.engine.start()
    thread = threading.Thread(target=uv.run, name="test-uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "uvicorn did not start"
    try:
        yield SimpleNamespace(built=built, base=base)
    finally:
        uv.should_exit = True
        thread.join(10)
        built.engine.stop()


async def _one(client: httpx.AsyncClient, base: str, rng: random.Random, seen: Counter[str]) -> None:
    kind = rng.choice(["whole", "stream", "cut_stream", "cancel", "cut_body", "oversized", "malformed", "chat"])
    body: dict[str, Any] = {"prompt": "one two three " * rng.randint(1, 8), "max_tokens": rng.randint(4, 24),
                            "temperature": rng.choice([0, 0.7]), "ignore_eos": True, "n": rng.choice([1, 2])}
    url = f"{base}/v1/completions"
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "hello " * rng.randint(1, 6)}], "max_tokens": 8,
                "stream": rng.random() < 0.5}
        url = f"{base}/v1/chat/completions"
    if kind in ("whole", "chat"):
        seen[str((await client.post(url, json=body)).status_code)] += 1
    elif kind in ("stream", "cut_stream"):
        async with client.stream("POST", url, json={**body, "stream": True}) as reply:
            seen[str(reply.status_code)] += 1
            async for line in reply.aiter_lines():
                if kind == "cut_stream" and line.startswith("data: {"):
                    break  # leaving the block closes the connection mid-stream
    elif kind == "cancel":
        task = asyncio.create_task(client.post(url, json={**body, "max_tokens": 100}))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        seen["cancelled"] += 1
        await asyncio.gather(task, return_exceptions=True)
    elif kind == "cut_body":  # a head promising 1000 bytes, 10 of them, then the connection closes
        _, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\":")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        seen["cut_body"] += 1
    elif kind == "oversized":
        seen[str((await client.post(url, content=b"x" * 70000,
                                    headers={"Content-Type": "application/json"})).status_code)] += 1
    else:
        seen[str((await client.post(url, content=b'{"prompt": "x", "max_tokens": NaN}',
                                    headers={"Content-Type": "application/json"})).status_code)] += 1


def _round(base: str, seed: int) -> Counter[str]:
    """ROUND_REQUESTS mixed requests, CONCURRENCY at a time; afterwards every client is closed."""
    rng = random.Random(seed)
    seen: Counter[str] = Counter()

    async def run() -> None:
        queue = list(range(ROUND_REQUESTS))

        async def worker() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                while queue:
                    queue.pop()
                    await _one(client, base, rng, seen)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    asyncio.run(run())
    return seen


def _settle(built: BuiltServer, timeout: float = 10.0) -> None:
    """Wait until the server holds no request and no connection (the clients just closed theirs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engine = built.engine.engine
        if (built.engine.num_in_flight == 0 and not engine.has_unfinished() and not engine.requests
                and built.limits.open_connections == 0
                and engine.num_free_blocks() == engine.block_manager.num_total_blocks):
            return
        time.sleep(0.05)


def _type_name(obj: object) -> str:
    """The object's type by module and name. A cancelled asyncio timer is counted apart: each request's
    `asyncio.timeout(request_timeout)` handle, cancelled when the request ends, stays in the event loop's heap
    until asyncio purges cancelled handles (once they are over half of at least 100 scheduled), so that count
    rises over rounds and falls again by asyncio's own bound; a timer still armed would be a leak."""
    module = getattr(type(obj), "__module__", None)
    if not isinstance(module, str):
        return ""
    name = f"{module}.{type(obj).__qualname__}"
    return f"{name} (cancelled)" if isinstance(obj, asyncio.TimerHandle) and obj.cancelled() else name


def _snapshot(built: BuiltServer) -> SimpleNamespace:
    _settle(built)
    gc.collect()
    engine = built.engine.engine
    objects = Counter(name for name in map(_type_name, gc.get_objects())
                      if name.startswith(("flashllm", "starlette", "uvicorn", "h11", "asyncio", "httpx")))
    return SimpleNamespace(
        fds=len(os.listdir("/proc/self/fd")),
        # the default executor (asyncio.to_thread) may still be growing toward its fixed maximum
        threads=sorted(t.name for t in threading.enumerate() if not t.name.startswith("asyncio_")),
        free_blocks=engine.num_free_blocks(), total_blocks=engine.block_manager.num_total_blocks,
        in_flight=built.engine.num_in_flight, requests=len(engine.requests), by_seq=len(engine._by_seq),
        connections=built.limits.open_connections, objects=objects,
    )


@pytest.fixture(scope="module")
def rounds(server: SimpleNamespace) -> list[tuple[Counter[str], SimpleNamespace]]:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("counting file descriptors needs /proc (Linux)")
    return [(_round(server.base, SEED + i), _snapshot(server.built)) for i in range(3)]


def test_the_rounds_exercised_every_path(rounds: list[tuple[Counter[str], SimpleNamespace]]) -> None:
    seen = sum((r[0] for r in rounds), Counter())
    for outcome in ("200", "400", "413", "503", "cancelled", "cut_body"):
        assert seen[outcome] > 0, f"no {outcome!r} in {dict(seen)}: the mix no longer covers it"
    assert not any(code.startswith("5") and code != "503" for code in seen), dict(seen)


def test_engine_state_and_kv_blocks_are_all_returned(rounds: list[tuple[Counter[str], SimpleNamespace]]) -> None:
    for _, snap in rounds:
        assert snap.free_blocks == snap.total_blocks, f"{snap.total_blocks - snap.free_blocks} KV blocks held"
        assert (snap.in_flight, snap.requests, snap.by_seq, snap.connections) == (0, 0, 0, 0)


def test_file_descriptors_and_threads_do_not_accumulate(rounds: list[tuple[Counter[str], SimpleNamespace]]) -> None:
    first = rounds[0][1]
    for _, snap in rounds[1:]:
        assert snap.fds == first.fds, f"open file descriptors {first.fds} -> {snap.fds}"
        assert snap.threads == first.threads, f"threads {first.threads} -> {snap.threads}"


def test_no_object_type_grows_with_the_requests(rounds: list[tuple[Counter[str], SimpleNamespace]]) -> None:
    first, second, third = (r[1].objects for r in rounds)
    grown = {name: (second[name] - first[name], third[name] - second[name]) for name in third
             if min(second[name] - first[name], third[name] - second[name]) >= LEAK_LIMIT
             and not name.endswith("(cancelled)")}
    assert not grown, f"live objects that grew in each of two rounds of {ROUND_REQUESTS} requests: {grown}"
