"""OpenAI batch files run through the server's own routes, in this process: `flashllm run-batch`.

Each input line is one request of the OpenAI Batch API's input format, `{"custom_id": ..., "method": "POST",
"url": "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" | "/v1/responses", "body": {...}}`; each output line, in
input order, is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}` with
the body the HTTP server would have answered (an OpenAI error body for a refused request), or, for a line that
is no such request, `"response": null` and `"error": {"code", "message"}`. The requests go to the server's ASGI
app without a socket, up to `concurrency` at a time, so they batch on the engine as concurrent clients do.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# The longest a custom_id may be (OpenAI's limit is not published; an id is a label, not data).
MAX_CUSTOM_ID = 512
# A request the engine has no seat for (503 queue_full) waits this long, doubling up to _MAX_WAIT_S, and tries
# again: a batch has no client to hand the 503 to.
_FIRST_WAIT_S = 0.05
_MAX_WAIT_S = 2.0


class LineError(Exception):
    """A line that is not a batch request: `code` and one-line `message` go to its output line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class BatchSummary:
    """What a run did: requests by the HTTP status they were answered with, lines that were no request (or
    whose request failed before an answer), and its seconds."""

    statuses: dict[int, int] = field(default_factory=dict)
    invalid: int = 0
    seconds: float = 0.0

    @property
    def succeeded(self) -> int:
        return sum(count for status, count in self.statuses.items() if 200 <= status < 300)

    @property
    def total(self) -> int:
        return sum(self.statuses.values()) + self.invalid

    def __str__(self) -> str:
        answered = ", ".join(f"{count} x {status}" for status, count in sorted(self.statuses.items()))
        return (f"{self.total} line(s): {self.succeeded} succeeded, {self.total - self.succeeded} failed "
                f"({answered or 'none answered'}; {self.invalid} without an answer) in {self.seconds:.1f} s")


def parse_line(line: str, max_bytes: int, seen: set[str]) -> tuple[str, str, bytes]:
    """(custom_id, url, body bytes) of one input line; LineError when it is not a batch request."""
    if len(line.encode()) > max_bytes:
        raise LineError("line_too_large", f"the line is larger than {max_bytes} bytes (--max-body-bytes)")
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise LineError("invalid_json", f"the line is not JSON: {exc}") from None
    if not isinstance(item, dict):
        raise LineError("invalid_request", "a line must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise LineError("invalid_custom_id", f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} "
                                             "characters")
    if custom_id in seen:
        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears on an earlier line; each must be "
                                               "unique so that answers can be matched to requests")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"method must be POST, got {item.get('method')!r}")
    url = item.get("url")
    if url not in BATCH_URLS:
        raise LineError("invalid_url", f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object: the request as it would be sent to the url")
    if body.get("stream"):
        raise LineError("stream_unsupported", "stream must be false in a batch: answers are written whole")
    return custom_id, url, json.dumps(body).encode()


def _error_line(custom_id: str | None, error: LineError) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": error.code, "message": str(error)}}


def _custom_id_of(line: str) -> str | None:
    """The line's custom_id where it has a readable one, for the output line of a refused request."""
    try:
        item = json.loads(line)
    except ValueError:
        return None
    value = item.get("custom_id") if isinstance(item, dict) else None
    return value if isinstance(value, str) and len(value) <= MAX_CUSTOM_ID else None


async def _answer(client: httpx.AsyncClient, custom_id: str, url: str, body: bytes) -> tuple[dict[str, Any], int]:
    """The output line of one request, and its HTTP status; a request without a seat waits and goes again."""
    wait = _FIRST_WAIT_S
    while True:
        reply = await client.post(url, content=body, headers={"content-type": "application/json"})
        if reply.status_code != 503 or _error_code(reply) != "queue_full":
            break
        await asyncio.sleep(wait)
        wait = min(2 * wait, _MAX_WAIT_S)
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": reply.status_code, "request_id": f"req_{uuid.uuid4().hex}",
                         "body": _json(reply)},
            "error": None}
    return line, reply.status_code


def _json(reply: httpx.Response) -> Any:
    """The reply's JSON body; None for one without (a request cut off by the server's shutdown)."""
    try:
        return reply.json()
    except ValueError:
        return None


def _error_code(reply: httpx.Response) -> str | None:
    body = _json(reply)
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


async def run_batch(app: Any, lines: Iterable[str], write: Callable[[str], None], concurrency: int,
                    max_bytes: int) -> BatchSummary:
    """Answer every line of `lines` through `app` (the server's ASGI app, its engine started), up to
    `concurrency` requests in flight; write(output line) in input order as the answers allow. Blank lines
    are skipped."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    summary, started = BatchSummary(), time.monotonic()
    seats = asyncio.Semaphore(concurrency)
    done: dict[int, tuple[dict[str, Any], int | None]] = {}
    next_out = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal next_out
        while next_out in done:
            line, status = done.pop(next_out)
            write(json.dumps(line))
            if status is None:
                summary.invalid += 1
            else:
                summary.statuses[status] = summary.statuses.get(status, 0) + 1
            next_out += 1

    async def one(index: int, custom_id: str, url: str, body: bytes, client: httpx.AsyncClient) -> None:
        try:
            done[index] = await _answer(client, custom_id, url, body)
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own line, not the batch's
            done[index] = (_error_line(custom_id, LineError("internal_error", f"{type(exc).__name__}: {exc}")), None)
        finally:
            seats.release()
        flush()

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        tasks, index = set(), 0
        for raw in lines:
            line = raw.strip()
            if not line:
                continue
            try:
                custom_id, url, body = parse_line(line, max_bytes, seen)
            except LineError as exc:
                done[index] = (_error_line(_custom_id_of(line), exc), None)
                index += 1
                flush()
                continue
            await seats.acquire()
            task = asyncio.create_task(one(index, custom_id, url, body, client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        if tasks:
            await asyncio.gather(*tasks)
    flush()
    summary.seconds = time.monotonic() - started
    return summary
