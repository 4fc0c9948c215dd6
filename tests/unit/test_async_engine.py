"""AsyncEngine: the engine thread, bounded admission, early exits freeing blocks, and failures."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from flashllm.core.engine import Engine
from flashllm.llm import engine_config
from flashllm.sampling_params import SamplingParams
from flashllm.serving.async_engine import FAULT_ENV, AsyncEngine, EngineDead, ServerBusy
from flashllm.testing.tiny_models import build_tiny_model

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("async"), "llama", seed=2, tokenizer=False)


def _engine(model_dir: Path) -> Engine:
    return Engine(engine_config(str(model_dir), backend="reference", max_model_len=256, block_size=16,
                                num_kv_blocks=32, max_num_seqs=2))


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_leaving_early_frees_blocks_even_when_the_engine_goes_idle(model_dir: Path) -> None:
    engine = AsyncEngine(_engine(model_dir), max_queue=0)
    engine.start()

    async def take_three() -> int:
        engine.reserve(["a"])
        seen = 0
        async for _ in engine.generate("a", list(range(1, 40)), LONG):
            seen += 1
            if seen == 3:
                break
        return seen

    try:
        assert asyncio.run(take_three()) == 3
        # Nothing else runs, so only the abort itself can refresh the stats.
        assert _wait(lambda: engine.stats.num_blocks_free == engine.stats.num_blocks_total)
        assert engine.num_in_flight == 0 and engine.engine.num_free_blocks() == 32
    finally:
        engine.stop()


def test_admission_is_bounded_and_all_or_nothing(model_dir: Path) -> None:
    engine = AsyncEngine(_engine(model_dir), max_queue=1)  # capacity 2 + 1

    async def scenario() -> None:
        engine.reserve(["a", "b"])
        with pytest.raises(ServerBusy):
            engine.reserve(["c", "d"])  # would need 4 seats
        engine.reserve(["c"])
        with pytest.raises(ServerBusy):
            engine.reserve(["d"])
        engine.release("a")
        engine.reserve(["d"])

    asyncio.run(scenario())
    assert engine.num_in_flight == 3


def test_a_failing_step_fails_requests_in_flight(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "forward_error_after:2")
    failures: list[BaseException] = []
    engine = AsyncEngine(_engine(model_dir), max_queue=0, on_fatal=failures.append)
    engine.start()

    async def run() -> int:
        engine.reserve(["a"])
        seen = 0
        with pytest.raises(EngineDead):
            async for _ in engine.generate("a", [1, 2, 3], LONG):
                seen += 1
        return seen

    try:
        assert asyncio.run(run()) == 2  # two good steps, then the injected failure
        assert engine.error is not None and _wait(lambda: len(failures) == 1)
        with pytest.raises(EngineDead):
            asyncio.run(_reserve(engine, "b"))
    finally:
        engine.stop()


async def _reserve(engine: AsyncEngine, request_id: str) -> None:
    engine.reserve([request_id])
