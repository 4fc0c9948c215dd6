"""Mutated raw HTTP/1.1 requests against the connection layer of a live server.

Seeds are well-formed requests (GET, POST with Content-Length, chunked POST, two pipelined
requests); each example applies a few random mutations (byte flips, inserted CR/LF/NUL/space,
duplicated or dropped header lines, framing headers added, case changes, truncation) and sends
the result on its own connection, then half-closes it. Checked for every example: no 5xx, every
reply parses as HTTP/1.1 responses, and a refusal that closes the connection is the last thing
on it, so no request hidden behind it is answered. Afterwards the server is healthy, holds no connection
and logged no traceback.
"""

from __future__ import annotations

import os
import random
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from flashllm.testing.server import ServerProcess

EXAMPLES = int(os.environ.get("FLASHLLM_FUZZ_EXAMPLES", "150")) * 70  # 10,500 at the default
SEED = 40
BODY = b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}'
SEEDS = [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(BODY)).encode() + b"\r\n\r\n" + BODY,
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + hex(len(BODY))[2:].encode() + b"\r\n" + BODY + b"\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
]
EXTRA_LINES = [b"Content-Length: 0", b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: 1e3",
               b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked", b"Transfer-Encoding:\tchunked",
               b"Transfer-Encoding : chunked", b" Transfer-Encoding: chunked", b"Host: other",
               b"Authorization: Bearer x", b"Expect: 100-continue", b"Connection: close", b"Upgrade: h2c",
               b"X-Long: " + b"a" * 70000, b"\x00: \x00", b"Content-Type: text/plain"]
STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
WORKERS = 16


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(8)
        at = rng.randrange(len(out) + 1)
        if kind == 0 and out:  # flip a byte
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1:  # insert a delimiter-ish byte
            out[at:at] = rng.choice([b"\r", b"\n", b"\x00", b" ", b"\t", b":", b"\r\n", b"\r\n\r\n", b"0\r\n"])
        elif kind == 2 and out:  # drop a span
            out[at:at + rng.randint(1, 8)] = b""
        elif kind in (3, 4):  # add a header line after the request line
            end = out.find(b"\r\n")
            line = rng.choice(EXTRA_LINES)
            out[end + 2:end + 2] = line + b"\r\n" if end >= 0 else b""
        elif kind == 5:  # duplicate a header line
            lines = bytes(out).split(b"\r\n")
            if len(lines) > 2:
                i = rng.randrange(1, len(lines))
                lines.insert(i, lines[i])
                out = bytearray(b"\r\n".join(lines))
        elif kind == 6:  # case games
            out = bytearray(bytes(out).swapcase() if rng.random() < 0.2 else bytes(out).replace(b"chunked", b"Chunked"))
        else:  # truncate
            del out[rng.randrange(len(out) + 1):]
    return bytes(out)


def _send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # refused and closed before everything was sent: what came back still counts
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def _problems(data: bytes, received: bytes) -> list[str]:
    starts = [m.start() for m in STATUS.finditer(received)]
    replies = [received[a:b] for a, b in zip(starts, [*starts[1:], len(received)][:len(starts)], strict=True)]
    statuses = [int(STATUS.match(r).group(1)) for r in replies]  # type: ignore[union-attr]
    problems = []
    if received and starts[:1] != [0]:
        problems.append("a reply that does not start with a status line")
    if any(s >= 500 for s in statuses):
        problems.append(f"server error {statuses}")
    # The connection layer refuses bad framing with `connection: close` and closes: nothing may follow.
    # (A 400 from the API, for a bad body in a well-framed request, keeps the connection open.)
    closing = [i for i, r in enumerate(replies) if b"\r\nconnection: close\r\n" in r.split(b"\r\n\r\n")[0].lower()]
    if closing and closing[0] != len(replies) - 1:
        problems.append(f"an answer after a refusal that closed the connection: {statuses}")
    return [f"{p}; sent {data[:300]!r}, got {received[:300]!r}" for p in problems]


def test_mutated_requests_never_get_5xx_or_an_answer_after_a_refusal(fuzz_server: ServerProcess) -> None:
    rng = random.Random(SEED)
    inputs = [_mutate(rng, rng.choice(SEEDS)) for _ in range(EXAMPLES)]
    with ThreadPoolExecutor(WORKERS) as pool:
        received = list(pool.map(lambda data: _send(fuzz_server.port, data), inputs))
    problems = [p for data, got in zip(inputs, received, strict=True) for p in _problems(data, got)]
    assert problems == [], f"{len(problems)} of {EXAMPLES}: {problems[:5]}"
    assert sum(bool(STATUS.match(got)) for got in received) > EXAMPLES // 2, "most inputs got no answer at all"


def test_the_server_is_healthy_afterwards(fuzz_server: ServerProcess) -> None:
    assert httpx.get(f"{fuzz_server.base_url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 15
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{fuzz_server.base_url}/metrics", timeout=10).text
        if re.search(r"^flashllm:connections_open\{[^}]*\} 1\.0$", text, re.MULTILINE):
            break  # only this scrape's own connection is open
        time.sleep(0.2)
    assert re.search(r"^flashllm:connections_open\{[^}]*\} 1\.0$", text, re.MULTILINE), text[-2000:]
    assert "Traceback" not in fuzz_server.log()
