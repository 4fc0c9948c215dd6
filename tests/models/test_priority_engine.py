"""scheduling_policy "priority" through the engine and the server's engine thread: requests run by priority (lower
first), their tokens are those of arrival order, and a priority without the policy is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashllm.llm import LLM, engine_config
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("priority"), "llama", seed=2, tokenizer=False)


def _llm(model_dir: Path, policy: str) -> LLM:
    return LLM(str(model_dir), backend="reference", block_size=16, num_kv_blocks=32, max_num_seqs=1,
               scheduling_policy=policy)


def test_one_seat_serves_the_lowest_priority_first_with_unchanged_tokens(model_dir: Path) -> None:
    by_priority = _llm(model_dir, "priority").generate(PROMPTS, PARAMS, priority=[5, -1, 2])
    by_arrival = _llm(model_dir, "fcfs").generate(PROMPTS, PARAMS)
    order = sorted(range(3), key=lambda i: by_priority[i].metrics.finished_time)
    assert order == [1, 2, 0]
    assert sorted(range(3), key=lambda i: by_arrival[i].metrics.finished_time) == [0, 1, 2]
    assert [o.outputs[0].token_ids for o in by_priority] == [o.outputs[0].token_ids for o in by_arrival]


def test_a_priority_needs_the_policy(model_dir: Path) -> None:
    llm = _llm(model_dir, "fcfs")
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        llm.generate(PROMPTS[:1], PARAMS, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        _llm(model_dir, "priority").generate(PROMPTS[:1], PARAMS, priority=[1.5])


def test_the_server_engine_thread_passes_each_request_s_priority(model_dir: Path) -> None:
    """A long request holds the one seat; of two that wait, the lower priority runs next although it came last."""
    from flashllm.core.engine import Engine
    from flashllm.serving.async_engine import AsyncEngine

    engine = AsyncEngine(Engine(engine_config(str(model_dir), backend="reference", block_size=16, num_kv_blocks=32,
                                              max_num_seqs=1, scheduling_policy="priority")), max_queue=4)
    engine.start()
    finished: list[str] = []

    async def run(name: str, prompt: list[int], max_tokens: int, priority: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        waiting: list[asyncio.Task] = []
        async for output in engine.generate(name, prompt, params, priority=priority):
            if name == "hold" and not waiting:  # the seat is taken: both others queue behind it, low one first
                waiting = [asyncio.create_task(run("late-low", PROMPTS[1], 4, 9)),
                           asyncio.create_task(run("later-high", PROMPTS[2], 4, 1))]
            if output.finished:
                finished.append(name)
        await asyncio.gather(*waiting)

    async def main() -> None:
        engine.reserve(["hold", "late-low", "later-high"])
        await run("hold", PROMPTS[0], 100, 0)

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    assert finished == ["hold", "later-high", "late-low"]
