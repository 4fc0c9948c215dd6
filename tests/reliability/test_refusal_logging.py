"""What a client can make the server log: one INFO line per refused request, no WARNING per request.

uvicorn logs a WARNING for every malformed request ("Invalid HTTP request received.") and two for
every request with an Upgrade header, and asyncio one for every write to a connection the client
already reset: each a free way to flood the log. The connection layer logs one INFO line per
refusal instead, naming the client and the reason.
"""

from __future__ import annotations

import functools
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from flashllm.serving.connection import ConnectionLimits, GuardedH11Protocol
from flashllm.testing.server import free_port

SMUGGLE = (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
           b"GET /hidden HTTP/1.1\r\nHost: x\r\n\r\n")
GARBAGE = b"NOT HTTP AT ALL\r\n\r\n"
UPGRADE = b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
STREAM = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
REPEATS = 5


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    streaming = scope["path"] == "/stream"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if not streaming:
        await send({"type": "http.response.body", "body": b"ok"})
        return
    for _ in range(2000):  # many writes per turn of the loop, long after the client reset the connection
        await send({"type": "http.response.body", "body": b"x" * 4096, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    number = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=number, log_level="warning", access_log=False,
                            http=functools.partial(GuardedH11Protocol, limits=ConnectionLimits()))  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield number
    server.should_exit = True
    thread.join(10)


def _exchange(port: int, data: bytes, reset_after_first_read: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if reset_after_first_read:
            sock.recv(1024)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
            return b""
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_refusals_log_one_info_line_each_and_client_noise_no_warning(port: int, caplog: pytest.LogCaptureFixture
                                                                     ) -> None:
    with caplog.at_level(logging.DEBUG):
        for _ in range(REPEATS):
            assert _exchange(port, SMUGGLE).count(b"HTTP/1.1 ") == 1  # the 400; the hidden GET never answered
            assert _exchange(port, GARBAGE).startswith(b"HTTP/1.1 400 ")
            assert _exchange(port, UPGRADE).startswith(b"HTTP/1.1 200 ")
            _exchange(port, STREAM, reset_after_first_read=True)
        time.sleep(1.0)  # the streams' writes after the resets
    loud = [f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == []
    refusals = [r for r in caplog.records if r.name == "flashllm.serve" and r.levelno == logging.INFO]
    assert len(refusals) == 2 * REPEATS, [r.getMessage() for r in refusals]
    smuggled = [r.getMessage() for r in refusals if "Content-Length and Transfer-Encoding" in r.getMessage()]
    assert len(smuggled) == REPEATS and all("127.0.0.1:" in m for m in smuggled)
