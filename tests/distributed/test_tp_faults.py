"""A tensor-parallel rank that dies or hangs: generate raises, the server fails and exits non-zero, no process stays."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from flashllm import LLM, SamplingParams
from flashllm.core.parallel import DIST_TIMEOUT_ENV, HEARTBEAT_ENV, DistributedError
from flashllm.testing.processes import children, descendants, wait_gone
from flashllm.testing.server import ServerProcess
from flashllm.testing.timing import time_limit
from flashllm.testing.tiny_models import build_tiny_model

FAIL_WITHIN_S = 30.0
HANG_TIMEOUT_S = 5  # FLASHLLM_DIST_TIMEOUT_S for the hung-rank tests: a collective fails after it
HEARTBEAT_S = 0.5  # FLASHLLM_DIST_HEARTBEAT_S for the idle hung-rank test
HUNG = f"a rank did not answer within {DIST_TIMEOUT_ENV}={HANG_TIMEOUT_S} s"  # what the engine's error says
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tp-faults"), "qwen2", seed=5)


def test_a_rank_killed_mid_generation_fails_generate_fast(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, block_size=16, num_kv_blocks=128)
    (worker,) = [proc.pid for proc in llm.engine.executor._launcher.procs]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    killer = threading.Timer(1.0, os.kill, (worker, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1"):
        llm.generate([[5, 6, 7, 8]] * 4, params, use_tqdm=False)
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert wait_gone([worker], 5) == []
    assert llm.engine.num_free_blocks() == llm.engine.block_manager.num_total_blocks  # the requests were aborted
    with pytest.raises(DistributedError):  # the engine stays failed: it cannot step without its rank
        llm.generate([[5, 6]], params, use_tqdm=False)


def _served(model_dir: Path, env: dict[str, str] | None = None) -> AbstractContextManager[ServerProcess]:
    pytest.importorskip("fastapi")
    from flashllm.testing.server import running_server

    flags = [str(model_dir), "--tensor-parallel-size", "2", "--block-size", "16", "--num-kv-blocks", "64",
             "--max-model-len", str(MAX_MODEL_LEN)]
    return running_server(flags, env)


def _rank_process(server: ServerProcess) -> int:
    # the rank is the spawned child (multiprocessing's resource tracker is a child too)
    workers = [pid for pid in children(server.proc.pid)
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, "the server should have started one rank process"
    return workers[0]


def _wait_exit(server: ServerProcess, after: str) -> int:
    try:
        return server.proc.wait(timeout=FAIL_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {FAIL_WITHIN_S} s after {after}:\n{server.log()[-3000:]}")


def _probe(url: str) -> int | None:
    """GET url's status, or None when nothing answers any more (the server is exiting or gone)."""
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def test_the_server_fails_the_request_in_flight_and_exits_non_zero_when_a_rank_dies(model_dir: Path) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with _served(model_dir) as server:
        worker = _rank_process(server)
        processes = descendants(server.proc.pid)
        with httpx.Client(timeout=FAIL_WITHIN_S) as client, \
                client.stream("POST", f"{server.url}/completions", json=body) as response:
            assert response.status_code == 200
            events = (line.removeprefix("data: ") for line in response.iter_lines() if line)
            first = json.loads(next(events))
            assert first["choices"], "the first event should carry a token: the request is in the engine"
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)  # a hang here ends in httpx's read timeout, failing the test
        assert time.monotonic() - killed < FAIL_WITHIN_S
        assert rest and "[DONE]" not in rest, f"the stream should end with an error event: {rest[-3:]}"
        error = json.loads(rest[-1]).get("error")
        assert error is not None and error["code"] == "engine_dead" and "rank 1" in error["message"], rest[-1]
        # The server stops listening about half a second after the engine fails (serve's on_fatal), so
        # these probes, sent right after the error event, normally reach it; None: it was already gone.
        assert _probe(f"{server.base_url}/ready") in (503, None)
        assert _probe(f"{server.base_url}/health") in (503, None)
        code = _wait_exit(server, "rank 1 died")
        assert code != 0, server.log()[-3000:]
        assert wait_gone(processes, 5) == [], "a process the server started outlived it"
        assert "rank 1" in server.log()


def test_the_server_fails_requests_and_exits_non_zero_when_a_rank_hangs(model_dir: Path) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}
    with _served(model_dir, {DIST_TIMEOUT_ENV: str(HANG_TIMEOUT_S)}) as server:
        worker = _rank_process(server)
        processes = descendants(server.proc.pid)
        os.kill(worker, signal.SIGSTOP)  # alive but never answers again
        try:
            started = time.monotonic()
            response = httpx.post(f"{server.url}/completions", json=body, timeout=FAIL_WITHIN_S)
            assert time.monotonic() - started < FAIL_WITHIN_S
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_dead"
            assert HUNG in response.json()["error"]["message"]
            # not ready nor healthy from the failed answer on, until the server is gone
            assert _probe(f"{server.base_url}/ready") in (503, None)
            assert _probe(f"{server.base_url}/health") in (503, None)
            code = _wait_exit(server, "rank 1 hung")
            assert code != 0, server.log()[-3000:]
            assert wait_gone(processes, 5) == [], "a process the server started outlived it"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_an_idle_server_turns_not_ready_and_exits_non_zero_when_a_rank_hangs(model_dir: Path) -> None:
    # no request: only the heartbeat, a ping every HEARTBEAT_S while the engine idles, can notice the hang
    with _served(model_dir, {DIST_TIMEOUT_ENV: str(HANG_TIMEOUT_S), HEARTBEAT_ENV: str(HEARTBEAT_S)}) as server:
        worker = _rank_process(server)
        processes = descendants(server.proc.pid)
        try:
            time.sleep(3 * HEARTBEAT_S)  # a rank that answers its pings keeps the server ready
            assert _probe(f"{server.base_url}/ready") == 200, server.log()[-3000:]
            os.kill(worker, signal.SIGSTOP)  # alive but never answers again
            stopped = time.monotonic()
            # the next ping, its timeout, then the engine fails (no wait for a rank's exit: none exited)
            within = HEARTBEAT_S + HANG_TIMEOUT_S + time_limit(4.0)
            while (status := _probe(f"{server.base_url}/ready")) == 200 and time.monotonic() - stopped < within:
                time.sleep(0.1)
            assert status in (503, None), f"still ready {within:.1f} s after rank 1 stopped:\n{server.log()[-3000:]}"
            assert _probe(f"{server.base_url}/health") in (503, None)
            code = _wait_exit(server, "rank 1 hung while idle")
            assert code != 0, server.log()[-3000:]
            assert wait_gone(processes, 5) == [], "a process the server started outlived it"
            assert f"tensor-parallel heartbeat failed: {HUNG}" in server.log()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_a_rank_that_hangs_fails_generate_after_the_timeout(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DIST_TIMEOUT_ENV, str(HANG_TIMEOUT_S))
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, block_size=16, num_kv_blocks=128)
    (worker,) = [proc.pid for proc in llm.engine.executor._launcher.procs]
    os.kill(worker, signal.SIGSTOP)  # alive but never answers again
    started = time.monotonic()
    try:
        with pytest.raises(DistributedError, match=re.escape(HUNG)):
            llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        # the collective's timeout, then the hung rank is ended at once (not given JOIN_TIMEOUT_S to leave, as it
        # was never told to, nor RANK_EXIT_GRACE_S for its exit to be named, as a timeout means it did not exit)
        assert time.monotonic() - started < HANG_TIMEOUT_S + time_limit(4.0)
        assert wait_gone([worker], 15) == []  # the executor kills what it can no longer stop politely
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
