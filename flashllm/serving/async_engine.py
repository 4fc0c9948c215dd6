"""The engine in its own thread, fed and drained through thread-safe queues for asyncio callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashllm.core.engine import Engine
from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Fault injection for the reliability suite; never read unless this variable is set.
FAULT_ENV = "FLASHLLM_FAULT_INJECT"
IDLE_WAIT_S = 0.05
WATCHDOG_PERIOD_S = 0.5
DEFAULT_STALL_WARNING_S = 30.0


class StepEngine(Protocol):
    """An engine AsyncEngine drives besides the paged core.engine.Engine (static mode's StaticEngine).

    The same add_request / step / abort / has_unfinished as Engine; no KV blocks, so /metrics
    reports only its running and waiting sequences.
    """

    tokenizer: Any
    max_num_seqs: int

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...


class ServerBusy(RuntimeError):
    """The bounded queue is full: answer 503 with Retry-After."""


class Draining(RuntimeError):
    """The server is shutting down and takes no new requests."""


class EngineDead(RuntimeError):
    """The engine thread failed; every request in flight gets this error."""


class CutOff(RuntimeError):
    """The shutdown drain timeout passed before this request finished."""


@dataclass
class EngineStats:
    """A snapshot for /metrics, taken in the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    num_preemptions: int = 0
    # speculative decoding (zero when off): drafted and accepted tokens, tokens emitted by verified rounds
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_emitted: int = 0


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class _FaultInjector:
    """`FLASHLLM_FAULT_INJECT=forward_error_after:N`: the (N+1)-th engine step raises."""

    def __init__(self, spec: str) -> None:
        kind, _, count = spec.partition(":")
        if kind != "forward_error_after" or not count.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected forward_error_after:N")
        self.remaining = int(count)
        logger.warning("FAULT INJECTION ACTIVE (%s=%s): the engine will fail on purpose", FAULT_ENV, spec)

    def before_step(self) -> None:
        if self.remaining == 0:
            raise RuntimeError("injected forward failure (fault injection is on)")
        self.remaining -= 1


class AsyncEngine:
    """Runs `engine.step()` in a daemon thread; asyncio code submits requests and awaits outputs.

    Admission is bounded: at most `max_num_seqs + max_queue` requests are in flight (running or
    waiting); beyond that `generate` raises ServerBusy at once, before anything is allocated.
    Only the engine thread touches the engine: adds and aborts travel through an inbox queue,
    outputs come back through per-request asyncio queues. The engine is the paged Engine or a
    StepEngine (static mode's, one batch at a time).
    """

    def __init__(self, engine: Engine | StepEngine, max_queue: int,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 stall_warning_s: float = DEFAULT_STALL_WARNING_S) -> None:
        self.engine: Any = engine
        self.paged = isinstance(engine, Engine)
        self.capacity = (engine.config.scheduler.max_num_seqs if isinstance(engine, Engine)
                         else engine.max_num_seqs) + max_queue
        self.on_fatal = on_fatal
        self.error: BaseException | None = None
        self.draining = False
        self.stats = EngineStats(num_blocks_total=engine.block_manager.num_total_blocks,
                                 num_blocks_free=engine.num_free_blocks()) \
            if isinstance(engine, Engine) else EngineStats()
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashllm-engine", daemon=True)
        # the stall watchdog: when the engine loop last finished a step or found nothing to do
        self.stall_warning_s = stall_warning_s
        self.num_stalls = 0
        self._last_progress = time.monotonic()
        self._watchdog = threading.Thread(target=self._watch, name="flashllm-engine-watchdog", daemon=True)
        spec = os.environ.get(FAULT_ENV)
        self._fault = _FaultInjector(spec) if spec else None

    # ---- asyncio side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._watchdog.is_alive():
            self._watchdog.join(timeout)

    def seconds_since_step(self) -> float:
        """How long the engine loop has gone without finishing a step while requests are in flight (0: none)."""
        if self.num_in_flight == 0 or self.error is not None:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress)

    def _watch(self) -> None:
        """Warn once per stall (and count it) when the loop goes stall_warning_s without a step."""
        stalled_for = 0.0
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            seconds = self.seconds_since_step()
            if seconds >= self.stall_warning_s and not stalled_for:
                self.num_stalls += 1
                logger.warning("the engine loop has not stepped for %.1f s while %d request(s) are in flight",
                               seconds, self.num_in_flight)
            elif seconds < self.stall_warning_s and stalled_for:
                logger.warning("the engine loop stepped again after a %.1f s stall", stalled_for)
            stalled_for = seconds if seconds >= self.stall_warning_s else 0.0

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def reserve(self, request_ids: list[str]) -> None:
        """Claim seats for these requests or raise ServerBusy / Draining / EngineDead (all-or-nothing)."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        if self.draining:
            raise Draining("the server is shutting down")
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._streams) + len(request_ids) > self.capacity:
                raise ServerBusy(f"{len(self._streams)} requests in flight; the limit is {self.capacity}")
            for request_id in request_ids:
                self._streams[request_id] = _Stream(loop)

    def release(self, request_id: str) -> None:
        """Give back a seat (and abort the request if the engine still runs it)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._inbox.put(("abort", request_id))
            self._wake.set()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) run on the engine thread between steps (the only thread touching the engine); its result."""
        if self.error is not None:
            raise EngineDead(f"the engine failed: {self.error}")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lora_request: Any = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one reserved request, step by step, the last one with `finished` set.

        Leaving the iteration early (client disconnect, timeout, cancellation) aborts the
        request and frees its KV blocks.
        """
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise RuntimeError(f"request {request_id!r} has no seat: call reserve() first")
        # only what was asked reaches add_request: static mode's engine takes neither option
        options = {k: v for k, v in (("lora_request", lora_request), ("priority", priority)) if v}
        self._inbox.put(("add", request_id, prompt_token_ids, params, options))
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.release(request_id)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    if self.paged:  # a tensor-parallel rank that died or hangs while idle ends the engine too
                        self.engine.check_health()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    self._last_progress = time.monotonic()  # idle is not stalled
                    continue
                if self._fault is not None:
                    self._fault.before_step()
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
                self._snapshot()
                self._last_progress = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine; requests must learn it
            self._fail(exc)

    def _drain_inbox(self) -> None:
        changed = False
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                if changed:  # an abort on an idle engine frees blocks that no step will report
                    self._snapshot()
                return
            changed = True
            if message[0] == "abort":
                self.engine.abort(message[1])
                continue
            if message[0] == "call":
                _run_call(self.engine, message[1], message[2])
                continue
            _, request_id, prompt_token_ids, params, options = message
            with self._lock:
                alive = request_id in self._streams
            if not alive:
                continue  # released before it reached the engine
            try:
                self.engine.add_request(prompt_token_ids, params, request_id=request_id, **options)
            except ValueError as exc:
                self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
        elif isinstance(item, RequestOutput) and not item.finished:
            self.engine.abort(request_id)  # nobody listens any more

    def _snapshot(self) -> None:
        if not self.paged:
            self.stats = EngineStats(num_running=self.engine.num_running, num_waiting=self.engine.num_waiting)
            return
        scheduler = self.engine.scheduler
        speculator = getattr(self.engine, "speculator", None)
        spec = speculator.stats if speculator is not None else None
        self.stats = EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_blocks_total=self.engine.block_manager.num_total_blocks,
            num_blocks_free=self.engine.num_free_blocks(),
            num_preemptions=scheduler.num_preemptions,
            spec_rounds=spec.num_rounds if spec else 0,
            spec_drafted=spec.num_drafted if spec else 0,
            spec_accepted=spec.num_accepted if spec else 0,
            spec_emitted=spec.num_emitted if spec else 0,
        )

    def _fail(self, exc: BaseException) -> None:
        logger.error("the engine failed; failing every request in flight", exc_info=exc)
        self.error = exc
        self._put_all(EngineDead(f"the engine failed: {type(exc).__name__}: {exc}"))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def cut_off(self) -> int:
        """Fail every request in flight with CutOff (the drain timeout passed); returns how many."""
        return self._put_all(CutOff("the server shut down before this request finished "
                                    "(--shutdown-drain-timeout passed)"))

    def _put_all(self, error: BaseException) -> int:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)
        return len(streams)

    def wait_idle(self, timeout: float) -> bool:
        """Block (not in the event loop) until nothing is in flight or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.num_in_flight == 0


def _run_call(engine: Any, fn: Callable[[Any], Any], future: concurrent.futures.Future[Any]) -> None:
    """AsyncEngine.call's body on the engine thread: the caller gets the result or the exception."""
    try:
        future.set_result(fn(engine))
    except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
        future.set_exception(exc)
