"""The HTTP/1.1 connection layer: read timeouts, idle and open-connection limits, strict request framing."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("flashllm.serve")

# h11 ends a request head at the first empty line and splits lines on CRLF or a bare LF; the framing
# check below reads the head with the same rules, so it sees exactly the header lines h11 will see.
_HEAD_END = re.compile(rb"\n\r?\n")
_LINE_SPLIT = re.compile(rb"\r?\n")
# One of each per request: a second copy is how framing and credential confusion attacks start.
_SINGLE_HEADERS = (b"content-length", b"transfer-encoding", b"authorization", b"host")

# uvicorn's per-request WARNINGs about what a client sent (any client can cause them at will, so at
# WARNING they are a free way to flood the log): lowered to DEBUG; a refusal logs one INFO line itself.
_CLIENT_CAUSED_WARNINGS = ("Invalid HTTP request received.", "Unsupported upgrade request.",
                           "No supported WebSocket library detected.")
H11_DEFAULT_HEAD_LIMIT = 16 * 1024  # h11's own default for max_incomplete_event_size
# phases of one connection, which decide the timer that is armed
_WAIT, _HEAD, _BODY, _APP = "wait", "head", "body", "app"


@dataclass
class ConnectionLimits:
    """What the connection layer enforces, and what it counted (read by /metrics).

    header_timeout: seconds from a request head's first byte until it is complete.
    body_timeout: seconds from a complete head until the whole body has arrived.
    keep_alive_timeout: seconds a connection may sit with no request started (new or between requests).
    max_connections: open connections beyond which a new one gets 503 and is closed at once.
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1000
    open_connections: int = 0
    closed: dict[str, int] = field(default_factory=dict)  # reason -> connections closed by the server

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")

    def count(self, reason: str) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + 1


def framing_problem(head: bytes) -> str | None:
    """Why a raw request head must be refused (RFC 9112 sections 6.1-6.3), or None when it may pass.

    `head` is the request line and header lines up to the empty line. Refused: Content-Length together
    with Transfer-Encoding, a Transfer-Encoding other than exactly `chunked` (h11 would strip the
    trailing whitespace of `chunked ` and accept it), a Content-Length that is not plain digits, and
    a second Content-Length, Transfer-Encoding, Authorization or Host header (even with equal values,
    which h11 merges silently).
    """
    seen: dict[bytes, list[bytes]] = {}
    last: bytes | None = None
    for line in _LINE_SPLIT.split(head)[1:]:
        if line[:1] in (b" ", b"\t") and last is not None:  # obsolete line folding continues a value
            seen[last][-1] += b" " + line.strip(b" \t")
            continue
        name, colon, value = line.partition(b":")
        if not colon:
            continue  # the request line or the final empty line; h11 rejects anything else malformed
        last = name.strip().lower()
        seen.setdefault(last, []).append(value.lstrip(b" \t"))
    for name in _SINGLE_HEADERS:
        if len(seen.get(name, ())) > 1:
            return f"the request has {len(seen[name])} {name.decode()} headers; send exactly one"
    if b"transfer-encoding" in seen and b"content-length" in seen:
        return "the request has both Content-Length and Transfer-Encoding; send one of them"
    if b"transfer-encoding" in seen and seen[b"transfer-encoding"][0].lower() != b"chunked":
        return "Transfer-Encoding must be exactly 'chunked'"
    if b"content-length" in seen and not seen[b"content-length"][0].rstrip(b" \t").isdigit():
        return "Content-Length must be a decimal number of bytes"
    return None


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"


def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A complete `Connection: close` response with an OpenAI-shaped error body (written past h11's state)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


def _not_a_write_after_disconnect(record: logging.LogRecord) -> bool:
    """asyncio's WARNING for each write past the 5th to a connection the client already closed.

    A streaming reply can write several events in one turn of the event loop before uvicorn learns
    that its client went away, so every client that hangs up mid-stream could log it: dropped.
    """
    return record.getMessage() != "socket.send() raised exception."


class _ClientNoiseToDebug(logging.LoggerAdapter):  # type: ignore[type-arg]
    """uvicorn.error as one connection's protocol uses it, with the client-caused warnings at DEBUG."""

    @property
    def level(self) -> int:  # uvicorn reads logger.level to decide on TRACE logging
        return self.logger.level

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if isinstance(msg, str) and msg.startswith(_CLIENT_CAUSED_WARNINGS):
            self.debug(msg, *args, **kwargs)
        else:
            super().warning(msg, *args, **kwargs)


class _CheckedConnection(h11.Connection):
    """h11's server connection that checks each raw request head's framing and reports its phases."""

    def __init__(self, protocol: GuardedH11Protocol, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._protocol = protocol
        self._max_head = max_incomplete_event_size
        # The bytes buffered since this request's head began, kept while it is awaited, and how far
        # they were searched for the head's end: a head sent in many small pieces is scanned once
        # in all (linear), not once per piece.
        self._head: bytearray | None = None
        self._searched = 0

    def receive_data(self, data: bytes) -> None:
        super().receive_data(data)
        if self._head is not None:
            self._head += data

    def next_event(self) -> Any:
        if self.their_state is h11.IDLE:
            self._check_head()
        event = super().next_event()
        if isinstance(event, h11.Request):
            self._head = None  # consumed; the next cycle starts from h11's buffer again
            self._protocol.phase_changed(_BODY)
        elif isinstance(event, h11.EndOfMessage):
            self._protocol.phase_changed(_APP)
        return event

    def _check_head(self) -> None:
        if self._head is None:  # a new cycle: whatever h11 holds now (pipelined bytes) starts the head
            self._head, self._searched = bytearray(self.trailing_data[0]), 0
        end = _HEAD_END.search(self._head, max(0, self._searched - 2), self._max_head + 2)
        self._searched = len(self._head)
        if end is None:
            return
        problem = framing_problem(bytes(self._head[:end.end()]))
        if problem is not None:
            self._protocol.refuse_framing(problem)
            # uvicorn answers a RemoteProtocolError with its 400 path (send_400_response)
            raise h11.RemoteProtocolError(problem, error_status_hint=400)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body read deadlines, an idle timeout and an open-connection cap.

    uvicorn itself only closes idle keep-alive connections after a response; a client that never
    finishes its head or body would hold its connection forever. One timer per connection is armed
    by phase: waiting for a request (keep_alive_timeout), reading a head (header_timeout, from its
    first byte, not reset by later bytes, so one byte a second does not keep it alive), reading a
    body (body_timeout, from the end of the head). While the app answers, no timer runs (the
    request timeout bounds that). Heads with ambiguous framing get 400 and the connection closes,
    so a request hidden behind them is never read.
    """

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        head_limit = config.h11_max_incomplete_event_size
        self.conn = _CheckedConnection(self, H11_DEFAULT_HEAD_LIMIT if head_limit is None else head_limit)
        self.logger = _ClientNoiseToDebug(self.logger, {})
        logging.getLogger("asyncio").addFilter(_not_a_write_after_disconnect)  # once: filters are a set
        self._phase = _WAIT
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: str | None = None
        self._counted = False

    # ---- connection lifetime -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.limits.open_connections += 1
        self._counted = True
        if self.limits.open_connections > self.limits.max_connections:
            self.limits.count("over_capacity")
            transport.write(_raw_response(503, "Service Unavailable", "too many open connections; retry shortly",
                                          "too_many_connections", "retry-after: 1\r\n"))
            transport.close()
            return
        self._arm(self.limits.keep_alive_timeout, "idle_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self.limits.open_connections -= 1
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == _WAIT:
            self._disarm()
            self._phase = _HEAD
            self._arm(self.limits.header_timeout, "header_timeout")
        super().data_received(data)

    def on_response_complete(self) -> None:
        if self._phase == _APP:
            self._phase = _WAIT
        # arms uvicorn's keep-alive timer (config.timeout_keep_alive) and parses a pipelined request
        super().on_response_complete()

    # ---- phases and timers ---------------------------------------------------------------------

    def phase_changed(self, phase: str) -> None:
        """Called by the h11 connection: a head was parsed (body phase) or the body ended (app phase)."""
        self._disarm()
        self._phase = phase
        if phase == _BODY:
            self._arm(self.limits.body_timeout, "body_timeout")
        elif self.cycle is not None and self.cycle.response_complete:
            # the app answered before reading the body (401, 413): the rest of the body was drained,
            # so the connection now waits for its next request
            self._phase = _WAIT
            self._arm(self.limits.keep_alive_timeout, "idle_timeout")

    def _arm(self, seconds: float, reason: str) -> None:
        self._deadline = self.loop.call_later(seconds, self._expired, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, reason: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.limits.count(reason)
        logger.debug("closing a connection from %s: %s", self.client, reason)
        answered = self.cycle is not None and self.cycle.response_started
        if reason == "header_timeout" or (reason == "body_timeout" and not answered):
            what = "request head" if reason == "header_timeout" else "request body"
            self.transport.write(_raw_response(408, "Request Timeout", f"the {what} did not arrive in time",
                                               reason))
        self.transport.close()

    # ---- refusals ------------------------------------------------------------------------------

    def refuse_framing(self, problem: str) -> None:
        """Remember why the next head is refused, for the 400 that uvicorn's error path sends."""
        self._refusal = problem
        self.limits.count("bad_framing")

    def send_400_response(self, msg: str) -> None:
        """400 with `Connection: close`, written raw: h11 may be in any state after a refused head."""
        self._disarm()
        message = self._refusal or "the request is not valid HTTP/1.1"
        logger.info("refused a request from %s and closed the connection: %s", _peer(self.client), message)
        self.transport.write(_raw_response(400, "Bad Request", message, "bad_request_framing"))
        self.transport.close()
