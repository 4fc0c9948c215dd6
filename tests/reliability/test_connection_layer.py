"""The connection layer against a live server: slow and idle clients closed, the cap, smuggling refused."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm.testing.server import ServerProcess, running_server
from flashllm.testing.timing import time_limit

HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 3.0
KEEP_ALIVE_TIMEOUT = 3.0
MAX_CONNECTIONS = 600
# A loaded 2-core machine fires timers late; a deadline that is not enforced misses by far more.
SLACK_S = 3.0
SLOW_HEADER_CLIENTS = 200
SLOW_BODY_CLIENTS = 200
IDLE_CLIENTS = 20
TRICKLE_EVERY_S = 0.5
NORMAL_REQUEST_LIMIT_S = 2.0
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")  # responses follow bodies with no separator


@dataclass
class ServerUnderTest:
    server: ServerProcess
    first_metrics: str  # scraped before any other request reached the server
    closed: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, helpers: SimpleNamespace) -> Iterator[ServerUnderTest]:
    flags = ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
             "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS)]
    with running_server([str(tiny_model_dir), *helpers.engine_flags, *flags]) as server:
        first = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        yield ServerUnderTest(server, first)


def test_metrics_report_every_kv_block_free_before_the_first_request(guarded: ServerUnderTest,
                                                                     helpers: SimpleNamespace) -> None:
    total = helpers.metric_value(guarded.first_metrics, "kv_blocks_total")
    assert total == 64
    assert helpers.metric_value(guarded.first_metrics, "kv_blocks_free") == total


# ---- slow and idle clients -----------------------------------------------------------------------

async def _slow_client(port: int, first: bytes, trickle: bytes, timeout: float) -> tuple[float, bytes]:
    """Send `first`, then one byte of `trickle` every TRICKLE_EVERY_S; (seconds until EOF, bytes received).

    The clock starts before connecting (the server's clocks start later: at accept, at the first byte
    or at the end of the head), so an early close cannot hide behind a slow client loop. Gives up
    (returns inf) after timeout + 10 s: bounded.
    """
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        if first:
            writer.write(first)
        stop_at = start + timeout + 10
        position = 0
        while time.monotonic() < stop_at:
            try:
                chunk = await asyncio.wait_for(reader.read(4096), TRICKLE_EVERY_S)
            except TimeoutError:
                if trickle:
                    writer.write(trickle[position % len(trickle):position % len(trickle) + 1])
                    position += 1
                continue
            except ConnectionError:
                return time.monotonic() - start, received
            if not chunk:
                return time.monotonic() - start, received
            received += chunk
        return float("inf"), received
    finally:
        writer.close()


class _NormalTraffic(threading.Thread):
    """Health checks and tiny completions on fresh connections, one after another, timing each."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        for i in range(1000):  # bounded; stopped by `done` long before
            if self.done.is_set():
                return
            start = time.monotonic()
            try:
                if i % 2:
                    reply = httpx.get(f"{self.base_url}/health", timeout=10)
                else:
                    reply = httpx.post(f"{self.base_url}/v1/completions", timeout=10,
                                       json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
                if reply.status_code != 200:
                    self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.latencies.append(time.monotonic() - start)
            time.sleep(0.1)


def test_slow_header_slow_body_and_idle_clients_are_closed_while_normal_requests_answer(
        guarded: ServerUnderTest, serving_checks: SimpleNamespace) -> None:
    port = guarded.server.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    slow_header = (head, b"X-Slow: " + b"a" * 200)  # never reaches the empty line that ends the head
    slow_body = (head + b"Content-Length: 1000\r\n\r\n", b'{"prompt": "' + b"x" * 1000)
    slack_s, normal_limit_s = time_limit(SLACK_S), time_limit(NORMAL_REQUEST_LIMIT_S)  # for the load it meets
    traffic = _NormalTraffic(guarded.server.base_url)
    traffic.start()

    async def main() -> list[tuple[float, bytes]]:
        tasks = [_slow_client(port, *slow_header, HEADER_TIMEOUT) for _ in range(SLOW_HEADER_CLIENTS)]
        tasks += [_slow_client(port, *slow_body, BODY_TIMEOUT) for _ in range(SLOW_BODY_CLIENTS)]
        tasks += [_slow_client(port, b"", b"", KEEP_ALIVE_TIMEOUT) for _ in range(IDLE_CLIENTS)]
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        traffic.done.set()
        traffic.join(30)
    header_results = results[:SLOW_HEADER_CLIENTS]
    body_results = results[SLOW_HEADER_CLIENTS:SLOW_HEADER_CLIENTS + SLOW_BODY_CLIENTS]
    idle_results = results[SLOW_HEADER_CLIENTS + SLOW_BODY_CLIENTS:]
    for name, group, timeout in (("slow-header", header_results, HEADER_TIMEOUT),
                                 ("slow-body", body_results, BODY_TIMEOUT),
                                 ("idle", idle_results, KEEP_ALIVE_TIMEOUT)):
        times = sorted(seconds for seconds, _ in group)
        early = [received[:300] for seconds, received in group if seconds < timeout - 0.5]
        assert not early, f"{name}: {len(early)} closed early, e.g. {early[0]!r}"
        assert times[-1] <= timeout + slack_s, f"{name}: slowest close after {times[-1]:.1f} s (timeout {timeout})"
        assert times[0] >= timeout - 0.5, f"{name}: closed after {times[0]:.1f} s, before the {timeout} s timeout"
    for _, received in header_results + body_results:
        assert STATUS_LINE.findall(received) == [b"408"], received[:300]
    assert traffic.failures == []
    assert len(traffic.latencies) >= 5
    assert max(traffic.latencies) < normal_limit_s, sorted(traffic.latencies)[-5:]
    metrics = httpx.get(f"{guarded.server.base_url}/metrics", timeout=10).text
    assert serving_checks.sample(metrics, "connections_closed_total", reason="header_timeout") >= SLOW_HEADER_CLIENTS
    assert serving_checks.sample(metrics, "connections_closed_total", reason="body_timeout") >= SLOW_BODY_CLIENTS
    assert serving_checks.sample(metrics, "connections_closed_total", reason="idle_timeout") >= IDLE_CLIENTS
    assert "Traceback" not in guarded.server.log()


def test_connections_beyond_the_cap_get_503_and_the_server_recovers(guarded: ServerUnderTest) -> None:
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10))
        time.sleep(0.5)  # let the server accept every one of them
        with socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10) as extra:
            reply = _read_until_eof(extra)
        assert STATUS_LINE.findall(reply) == [b"503"], reply[:300]
        assert b"retry-after:" in reply.lower()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the closes above reach the server asynchronously
        try:
            if httpx.get(f"{guarded.server.base_url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert httpx.get(f"{guarded.server.base_url}/health", timeout=5).status_code == 200


# ---- request smuggling ---------------------------------------------------------------------------

HIDDEN = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _post(headers: bytes, body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + headers
            + b"\r\n" + body)


SMUGGLING = {
    "CL.TE": _post(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),
    "TE.CL": _post(b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", b"2a\r\n" + HIDDEN + b"\r\n0\r\n\r\n"),
    "TE.TE duplicated": _post(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),
    "TE.TE second value": _post(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n", b"0\r\n\r\n"),
    "TE trailing space": _post(b"Transfer-Encoding: chunked \r\n", b"0\r\n\r\n"),
    "TE xchunked": _post(b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n"),
    "TE list": _post(b"Transfer-Encoding: chunked, identity\r\n", b"0\r\n\r\n"),
    "TE folded": _post(b"Transfer-Encoding: chunked\r\n identity\r\n", b"0\r\n\r\n"),
    "TE with CL 0": _post(b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),
    "duplicate CL, equal": _post(b"Content-Length: 2\r\nContent-Length: 2\r\n", b"{}"),
    "duplicate CL, list": _post(b"Content-Length: 2, 2\r\n", b"{}"),
    "duplicate CL, different": _post(b"Content-Length: 2\r\nContent-Length: 0\r\n", b"{}"),
    "duplicate Authorization": _post(b"Authorization: Bearer a\r\nAuthorization: Bearer b\r\nContent-Length: 2\r\n",
                                     b"{}"),
}


def _read_until_eof(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes; fails if it keeps the connection open past `limit_s`."""
    sock.settimeout(limit_s)
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open for {limit_s} s after: {data[:300]!r}")


@pytest.mark.parametrize("name", list(SMUGGLING))
def test_ambiguous_framing_gets_400_and_close_and_the_hidden_request_is_never_answered(
        guarded: ServerUnderTest, name: str) -> None:
    with socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10) as sock:
        sock.sendall(SMUGGLING[name] + HIDDEN)
        reply = _read_until_eof(sock)
    assert STATUS_LINE.findall(reply) == [b"400"], reply[:500]
    assert b"flashllm:" not in reply
    assert b"connection: close" in reply.lower()


def test_a_pipelined_request_behind_a_well_framed_one_is_answered(guarded: ServerUnderTest) -> None:
    """The control for the test above: the raw-socket check does see a second response when there is one."""
    with socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + HIDDEN[:-2] + b"Connection: close\r\n\r\n")
        reply = _read_until_eof(sock)
    assert STATUS_LINE.findall(reply) == [b"200", b"200"], reply[:500]
    assert b"flashllm:kv_blocks_total" in reply


# ---- a client that goes away mid-body --------------------------------------------------------------

def test_a_client_that_goes_away_mid_body_is_counted_and_logs_no_error(guarded: ServerUnderTest,
                                                                      serving_checks: SimpleNamespace) -> None:
    base = guarded.server.base_url
    before = serving_checks.sample(httpx.get(f"{base}/metrics", timeout=10).text, "client_disconnects_total")
    log_before = len(guarded.server.log())
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10) as sock:
            sock.sendall(_post(b"Content-Length: 1000\r\n", b'{"prompt": "unfinished'))
            time.sleep(0.2)  # the app is reading the body when the client leaves
    deadline = time.monotonic() + 10
    after = before
    while after < before + 5 and time.monotonic() < deadline:
        time.sleep(0.2)
        after = serving_checks.sample(httpx.get(f"{base}/metrics", timeout=10).text, "client_disconnects_total")
    assert after == before + 5
    new_log = guarded.server.log()[log_before:]
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log[-2000:]


@pytest.mark.parametrize("headers", [b"Content-Length: 2\r\n", b"Transfer-Encoding: chunked\r\n",
                                     b"Transfer-Encoding: Chunked\r\n", b"Transfer-Encoding:\tchunked\r\n",
                                     b"Content-Length:  17\r\nAuthorization: Bearer k\r\n", b""])
def test_well_framed_heads_pass_the_framing_check(headers: bytes) -> None:
    from flashllm.serving.connection import framing_problem

    for ending in (b"\r\n", b"\n"):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: h\r\n" + headers + b"\r\n").replace(b"\r\n", ending)
        assert framing_problem(head) is None, head


@pytest.mark.parametrize("name", list(SMUGGLING))
def test_the_framing_check_names_the_problem_of_each_smuggling_head(name: str) -> None:
    from flashllm.serving.connection import framing_problem

    head = SMUGGLING[name].split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    problem = framing_problem(head)
    assert problem is not None


def test_the_app_refuses_two_authorization_headers_even_when_one_is_valid(helpers: SimpleNamespace) -> None:
    """Behind a proxy that lets both through, which key counts must not be up to header order."""
    from starlette.testclient import TestClient

    from flashllm.serving.app import create_app

    key = helpers.api_keys[0]
    with TestClient(create_app(SimpleNamespace(), api_keys=[key])) as client:
        for pair in ([f"Bearer {key}", "Bearer wrong"], ["Bearer wrong", f"Bearer {key}"]):
            reply = client.get("/v1/models", headers=[("Authorization", value) for value in pair])
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["code"] == "duplicate_authorization"
            assert helpers.error_shape_problems(reply.json()) == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_a_mid_body_disconnect_is_one_info_line(caplog: pytest.LogCaptureFixture, serving_checks: SimpleNamespace,
                                                path: str) -> None:
    """The app alone, driven through ASGI: a body cut short by http.disconnect logs one INFO line and counts,
    on the LoRA admin routes (serve --enable-lora) as on the API's."""
    from flashllm.serving.app import create_app
    from flashllm.serving.async_engine import EngineStats
    from flashllm.serving.lora_api import LoRARoutes
    from flashllm.serving.metrics import ServerMetrics

    metrics = ServerMetrics("m", EngineStats)
    ctx = SimpleNamespace(metrics=metrics, loras={}, model_name="m")
    app = create_app(ctx, api_keys=["k"])  # type: ignore[arg-type]
    LoRARoutes(ctx, admin_keys=True, allowed_dirs=["/nonexistent"]).install(app)  # type: ignore[arg-type]
    messages = [{"type": "http.request", "body": b'{"lora_name": "a", "prompt": "unfini', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000"),
                         (b"authorization", b"Bearer k")],
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000)}
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))
    mine = [r for r in caplog.records if r.name.startswith("flashllm")]
    assert [r.levelno for r in mine] == [logging.INFO], [(r.levelname, r.getMessage()) for r in caplog.records]
    assert "127.0.0.1:5555" in mine[0].getMessage() and "\n" not in mine[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert serving_checks.sample(metrics.render().decode(), "client_disconnects_total") == 1


def test_a_smuggling_head_behind_a_good_request_on_one_connection_is_refused(guarded: ServerUnderTest) -> None:
    """The check runs on every request of a keep-alive connection, pipelined bytes included."""
    with socket.create_connection(("127.0.0.1", guarded.server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + SMUGGLING["CL.TE"] + HIDDEN)
        reply = _read_until_eof(sock)
    assert STATUS_LINE.findall(reply) == [b"200", b"400"], reply[:800]
    assert b"flashllm:" not in reply


class _Recorder:
    """Stands in for the protocol: records what the checked h11 connection reports."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.phases: list[str] = []

    def refuse_framing(self, problem: str) -> None:
        self.refused.append(problem)

    def phase_changed(self, phase: str) -> None:
        self.phases.append(phase)


@pytest.mark.parametrize("name", ["CL.TE", "TE trailing space", "duplicate CL, equal"])
def test_a_head_sent_one_byte_at_a_time_is_still_checked(name: str) -> None:
    import h11

    from flashllm.serving.connection import _CheckedConnection

    recorder = _Recorder()
    conn = _CheckedConnection(recorder, 64 << 10)  # type: ignore[arg-type]
    with pytest.raises(h11.RemoteProtocolError):
        for byte in SMUGGLING[name] + HIDDEN:
            conn.receive_data(bytes([byte]))
            while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED):
                pass
    assert len(recorder.refused) == 1 and recorder.phases == []


# ---- the framing check against two other parsers (hypothesis, seeded) -------------------------------

_FUZZ_NAMES = ["Content-Length", "content-length", "Transfer-Encoding", "TRANSFER-ENCODING", "Authorization", "Host",
               "X-A"]
_FUZZ_VALUES = ["chunked", "chunked ", "Chunked", "xchunked", "chunked, identity", "identity", "4", "4, 4", "+4",
                "04", "", "4 ", "Bearer k", "\tchunked"]
_FUZZ_LINE = st.one_of(
    st.tuples(st.sampled_from(_FUZZ_NAMES), st.sampled_from(_FUZZ_VALUES)).map(lambda nv: f"{nv[0]}: {nv[1]}"),
    st.sampled_from([" folded", "\tchunked", "Transfer-Encoding : chunked", "Content-Length:4", "X-B:"]),
)


@settings(max_examples=2000, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(_FUZZ_LINE, max_size=5), eol=st.sampled_from(["\r\n", "\n"]))
def test_a_head_the_check_lets_through_is_unambiguous_to_h11_and_to_pythons_parser(lines: list[str], eol: str) -> None:
    """Smuggling lives in parser disagreements: whatever passes must frame one way for h11 and http.client alike."""
    import io
    from http.client import parse_headers

    import h11

    from flashllm.serving.connection import framing_problem

    head = (eol.join(["POST / HTTP/1.1", "Host: h", *lines]) + eol + eol).encode()
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return  # refused by h11 anyway (uvicorn answers 400 and closes)
    if framing_problem(head) is not None or not isinstance(event, h11.Request):
        return
    names = [name.lower() for name, _ in event.headers]
    assert not (b"content-length" in names and b"transfer-encoding" in names), head
    other = parse_headers(io.BytesIO(head.split(b"\n", 1)[1]))
    for name in ("content-length", "transfer-encoding", "authorization", "host"):
        assert len(other.get_all(name) or []) <= 1, (name, head)
    encodings = other.get_all("transfer-encoding") or []
    assert all(value.strip().lower() == "chunked" for value in encodings), head
