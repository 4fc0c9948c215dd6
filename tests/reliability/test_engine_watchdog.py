"""The engine-stall watchdog: a loop that stops stepping while work is in flight shows in /metrics and the log."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from flashllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.serving.async_engine import WATCHDOG_PERIOD_S, AsyncEngine
from flashllm.serving.metrics import ServerMetrics

STALL_WARNING_S = 0.6


class _StuckEngine:
    """A StepEngine whose first step blocks until `release` is set (a hung kernel, a lost lock)."""

    tokenizer: Any = None
    max_num_seqs = 2

    def __init__(self) -> None:
        self.release = threading.Event()
        self.in_step = threading.Event()
        self.pending: list[str] = []

    @property
    def num_running(self) -> int:
        return len(self.pending)

    @property
    def num_waiting(self) -> int:
        return 0

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> str:
        assert request_id is not None
        self.pending.append(request_id)
        return request_id

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        assert self.release.wait(30), "the test never released the stuck step"
        done, self.pending = self.pending, []
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [2], "stop")], True,
                              RequestMetrics(time.monotonic())) for rid in done]

    def abort(self, request_id: str) -> None:
        self.pending = [r for r in self.pending if r != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.pending)


def _poll(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_stuck_step_raises_the_gauge_warns_once_and_clears_when_it_steps_again(
        caplog: pytest.LogCaptureFixture, serving_checks: SimpleNamespace) -> None:
    engine = _StuckEngine()
    async_engine = AsyncEngine(engine, max_queue=2, stall_warning_s=STALL_WARNING_S)
    metrics = ServerMetrics("m", lambda: async_engine.stats, stall=lambda: (async_engine.seconds_since_step(),
                                                                            async_engine.num_stalls))
    async_engine.start()
    try:
        time.sleep(3 * STALL_WARNING_S)  # idle for longer than the warning: idle is not a stall
        assert async_engine.seconds_since_step() == 0.0 and async_engine.num_stalls == 0

        async def one_request() -> list[RequestOutput]:
            async_engine.reserve(["r1"])
            return [out async for out in async_engine.generate("r1", [1], SamplingParams(max_tokens=1))]

        with caplog.at_level(logging.WARNING, logger="flashllm.serving.async_engine"):
            outputs: list[list[RequestOutput]] = []
            runner = threading.Thread(target=lambda: outputs.append(asyncio.run(one_request())), daemon=True)
            runner.start()
            assert engine.in_step.wait(10)
            assert _poll(lambda: async_engine.seconds_since_step() >= 2 * STALL_WARNING_S)
            scrape = metrics.render().decode()
            assert serving_checks.sample(scrape, "engine_seconds_since_step") >= 2 * STALL_WARNING_S
            assert _poll(lambda: async_engine.num_stalls == 1)
            time.sleep(3 * STALL_WARNING_S)  # still the same stall: counted and logged once
            assert async_engine.num_stalls == 1
            engine.release.set()
            runner.join(10)
            assert outputs and outputs[0][-1].finished
            assert _poll(lambda: async_engine.seconds_since_step() == 0.0)
            time.sleep(2 * WATCHDOG_PERIOD_S)
        warnings = [r.getMessage() for r in caplog.records if "has not stepped" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "1 request(s) are in flight" in warnings[0]
        assert any("stepped again" in r.getMessage() for r in caplog.records)
        scrape = metrics.render().decode()
        assert serving_checks.sample(scrape, "engine_stalls_total") == 1
        assert serving_checks.sample(scrape, "engine_seconds_since_step") == 0
    finally:
        engine.release.set()
        async_engine.stop()
