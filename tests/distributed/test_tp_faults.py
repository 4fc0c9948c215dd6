"""A tensor-parallel rank that dies: generate raises, the server exits non-zero, no process is left."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from flashllm import LLM, SamplingParams
from flashllm.core.parallel import DistributedError
from flashllm.testing.processes import children, wait_gone
from flashllm.testing.tiny_models import build_tiny_model

FAIL_WITHIN_S = 30.0


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


def test_the_server_exits_non_zero_when_a_rank_dies(model_dir: Path) -> None:
    pytest.importorskip("fastapi")
    from flashllm.testing.server import running_server

    flags = [str(model_dir), "--tensor-parallel-size", "2", "--block-size", "16", "--num-kv-blocks", "64",
             "--max-model-len", "128"]
    with running_server(flags) as server:
        server_pid = server.proc.pid
        # the rank is the spawned child (multiprocessing's resource tracker is a child too)
        workers = [pid for pid in children(server_pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1, "the server should have started one rank process"
        os.kill(workers[0], signal.SIGKILL)
        try:
            code = server.proc.wait(timeout=FAIL_WITHIN_S)
        except Exception:  # noqa: BLE001 - report the log, then fail
            pytest.fail(f"the server did not exit within {FAIL_WITHIN_S} s after rank 1 died:\n{server.log()[-3000:]}")
        assert code != 0, server.log()[-3000:]
        assert wait_gone(workers, 5) == [], "a rank process outlived the server"
        assert "rank 1" in server.log()


def test_a_rank_that_hangs_fails_generate_after_the_timeout(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHLLM_DIST_TIMEOUT_S", "5")
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, block_size=16, num_kv_blocks=128)
    (worker,) = [proc.pid for proc in llm.engine.executor._launcher.procs]
    os.kill(worker, signal.SIGSTOP)  # alive but never answers again
    started = time.monotonic()
    try:
        with pytest.raises(DistributedError):
            llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert time.monotonic() - started < FAIL_WITHIN_S
        assert wait_gone([worker], 15) == []  # the executor kills what it can no longer stop politely
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
