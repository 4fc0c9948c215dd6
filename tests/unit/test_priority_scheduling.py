"""scheduling_policy "priority": the waiting queue in (priority, arrival) order, running sequences scheduled in
that order so the lowest priority is preempted first; "fcfs" unchanged."""

from __future__ import annotations

import pytest

from flashllm.config import SchedulerConfig
from flashllm.core.block_manager import BlockManager
from flashllm.core.scheduler import Scheduler
from flashllm.core.sequence import Sequence
from flashllm.sampling_params import SamplingParams


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                             scheduling_policy=policy)
    return Scheduler(config, BlockManager(num_blocks, 4, enable_prefix_caching=False))


def _seq(name: str, priority: int, arrival: float, tokens: int = 4) -> Sequence:
    seq = Sequence(name, list(range(1, tokens + 1)), SamplingParams(), arrival_time=arrival)
    seq.priority = priority
    return seq


def _admitted(scheduler: Scheduler) -> list[str]:
    return [s.seq.request_id for s in scheduler.schedule().scheduled]


@pytest.mark.parametrize(("policy", "order"), [("priority", ["c", "a", "d", "b"]), ("fcfs", ["a", "b", "c", "d"])])
def test_waiting_requests_are_admitted_in_the_policy_s_order(policy: str, order: list[str]) -> None:
    scheduler = _scheduler(policy, max_num_seqs=1)
    for name, priority, arrival in [("a", 1, 0.0), ("b", 5, 1.0), ("c", -3, 2.0), ("d", 1, 3.0)]:
        scheduler.add(_seq(name, priority, arrival))
    admitted = []
    for _ in order:
        (name,) = _admitted(scheduler)  # one seat: the head of the queue
        admitted.append(name)
        scheduler.finish(scheduler.running[0], "stop")
    assert admitted == order


@pytest.mark.parametrize(("policy", "preempted", "scheduled"), [
    ("priority", ["low"], ["high", "mid"]),  # scheduled in priority order: the last, "low", makes room
    ("fcfs", ["mid"], ["low", "high"]),  # in admission order: the latest admitted, "mid", makes room
])
def test_the_policy_picks_who_is_preempted(policy: str, preempted: list[str], scheduled: list[str]) -> None:
    # 4 blocks of 4 tokens: three 4-token prompts take 3; each one's first decode needs one more, and 1 is free
    scheduler = _scheduler(policy, num_blocks=4)
    for name, priority, arrival in [("low", 9, 0.0), ("high", 0, 1.0), ("mid", 5, 2.0)]:
        scheduler.add(_seq(name, priority, arrival))
    first = scheduler.schedule()
    assert sorted(s.seq.request_id for s in first.scheduled) == ["high", "low", "mid"]
    scheduler.update(first, [7] * len(first.scheduled))
    out = scheduler.schedule()
    assert [s.request_id for s in out.preempted] == preempted
    assert [s.seq.request_id for s in out.scheduled] == scheduled
    assert [s.request_id for s in scheduler.waiting] == preempted


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        _scheduler("lifo")
