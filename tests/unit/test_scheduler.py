"""Scheduler: continuous batching, token budget, chunked prefill, preemption, abort, simulation."""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm.config import SchedulerConfig
from flashllm.core.block_manager import BlockManager
from flashllm.core.scheduler import Scheduler, SchedulerOutput
from flashllm.core.sequence import Sequence, SequenceStatus

EOS = 0
VOCAB = 64


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    caching: bool = True,
    **cfg: int | bool,
) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, caching))


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context it attends to."""
    digest = hashlib.sha256(struct.pack(f"<{len(context)}q", *context)).digest()
    return int.from_bytes(digest[:4], "little") % VOCAB


def solo_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What a request generates alone: no scheduler, no cache, just the model in a loop."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if out[-1] == EOS:
            break
    return out


class FakeModelRunner:
    """Writes each scheduled token into a fake paged KV cache (one token id per slot), then
    samples from the context read back through block_table: wrong blocks give wrong tokens."""

    def __init__(self, bm: BlockManager) -> None:
        self.bs = bm.block_size
        self.kv = [[-1] * bm.block_size for _ in range(bm.num_total_blocks)]

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bs], pos % self.bs

    def step(self, out: SchedulerOutput) -> list[int | None]:
        for item in out.scheduled:  # all writes of the batch land before any attention read
            start = item.seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                block, offset = self.slot(item.seq, pos)
                self.kv[block][offset] = item.seq.token_ids[pos]
        sampled: list[int | None] = []
        for item in out.scheduled:
            end = item.seq.num_computed_tokens + item.num_new_tokens
            assert item.produces_token == (end == item.seq.num_tokens)
            if end < item.seq.num_tokens:
                sampled.append(None)
                continue
            context = [self.kv[b][o] for b, o in (self.slot(item.seq, p) for p in range(end))]
            sampled.append(next_token(context))
        return sampled


@dataclass
class Request:
    arrival_step: int
    prompt: list[int]
    max_tokens: int


def check_batch(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_batched_tokens == sum(item.num_new_tokens for item in out.scheduled)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert sched.num_running <= cfg.max_num_seqs
    assert len({id(item.seq) for item in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        assert 1 <= item.num_new_tokens <= item.seq.num_uncomputed_tokens
        assert item.seq.status is SequenceStatus.RUNNING
        covered = len(item.seq.block_table) * sched.block_manager.block_size
        assert covered >= item.seq.num_computed_tokens + item.num_new_tokens
    check_budget_used(sched, out)


def check_budget_used(sched: Scheduler, out: SchedulerOutput) -> None:
    """The budget is used, not just respected: tokens are left over only when nothing could take them.

    A sequence gets part of its uncomputed tokens only at the budget's edge; a running sequence
    sits out only when the budget is spent or (prefill unchunked) its tokens do not fit what is
    left; the waiting head stays waiting with budget left only when seats are full, this step
    preempted, its next chunk does not fit unchunked, or its blocks are not free. Prompt work (more
    than one token left) also has max_prefill_tokens: it may stop at that edge, which only an
    unchunked prompt alone in its step exceeds.
    """
    cfg, bm = sched.config, sched.block_manager
    left = cfg.max_num_batched_tokens - out.num_batched_tokens
    prompt_items = [item for item in out.scheduled if item.seq.num_uncomputed_tokens > 1]
    prompt_left = left
    if cfg.max_prefill_tokens is not None:
        used = sum(item.num_new_tokens for item in prompt_items)
        assert used <= cfg.max_prefill_tokens or (not cfg.enable_chunked_prefill and len(prompt_items) == 1), \
            f"{used} prompt tokens in a step, more than max_prefill_tokens={cfg.max_prefill_tokens}"
        prompt_left = min(left, max(cfg.max_prefill_tokens - used, 0))

    def room(need: int) -> int:
        return left if need <= 1 else prompt_left

    if left == 0:
        return
    for item in out.scheduled:
        need = item.seq.num_uncomputed_tokens
        assert item.num_new_tokens == need or room(need) == 0, \
            f"a {item.num_new_tokens}-token chunk of {need} with {room(need)} budget left"
    scheduled = {id(item.seq) for item in out.scheduled}
    for seq in sched.running:
        if id(seq) not in scheduled:
            need = seq.num_uncomputed_tokens
            assert room(need) == 0 or (not cfg.enable_chunked_prefill and need > room(need)), \
                f"running sequence {seq.seq_id} sat out with {room(need)} budget left"
    if not sched.waiting or out.preempted or sched.num_running >= cfg.max_num_seqs:
        return
    head = sched.waiting[0]
    need = head.num_tokens - bm.num_prefix_hit_tokens(head)
    if room(need) == 0:
        return
    if need > room(need) and not cfg.enable_chunked_prefill and need <= cfg.max_num_batched_tokens:
        return  # an unchunked prompt waits for a step with room for all of it
    assert not bm.can_allocate(head, min(need, room(need))), f"the waiting head could run {min(need, room(need))} tokens"


def run_engine(sched: Scheduler, requests: list[Request], max_steps: int = 5000) -> list[Sequence]:
    """A minimal engine loop: arrivals, schedule, fake forward, update, stop checks."""
    runner = FakeModelRunner(sched.block_manager)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    seqs: list[Sequence] = []
    for step in range(max_steps):
        while pending and pending[0].arrival_step <= step:
            req = pending.pop(0)
            seqs.append(Sequence(str(len(seqs)), req.prompt, SimpleNamespace(max_tokens=req.max_tokens)))
            sched.add(seqs[-1])
        if not pending and not sched.has_unfinished():
            return seqs
        out = sched.schedule()
        check_batch(sched, out)
        for seq in sched.update(out, runner.step(out)):
            if seq.last_token_id == EOS:
                sched.finish(seq, "stop")
            elif seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish(seq, "length")
    raise AssertionError(f"requests did not finish in {max_steps} steps")


def check_outputs(sched: Scheduler, requests: list[Request], seqs: list[Sequence]) -> None:
    by_id = {seq.request_id: seq for seq in seqs}
    order = sorted(requests, key=lambda r: r.arrival_step)
    for i, req in enumerate(order):
        seq = by_id[str(i)]
        assert seq.is_finished and seq.finish_reason in ("stop", "length")
        assert seq.output_token_ids == solo_output(req.prompt, req.max_tokens)
        assert seq.block_table == []
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


# ---- simulation ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_simulation_matches_solo_runs_under_kv_pressure(chunked: bool, caching: bool) -> None:
    rng = random.Random(1234)
    # Shared system prompts make prefix hits, evictions and re-hits after eviction common.
    system_prompts = [[], *([rng.randrange(1, VOCAB) for _ in range(n)] for n in (4, 8, 9))]
    requests = []
    for _ in range(20):
        body = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 15))]
        prompt = (rng.choice(system_prompts) + body)[:24]
        requests.append(Request(rng.randrange(0, 30), prompt, rng.randint(1, 16)))
    # Longest sequence: 24 + 16 = 40 tokens = 10 blocks of 4; 14 blocks forces preemption, and
    # recomputes up to 40 tokens exceed the 32-token budget, so they must be split even unchunked.
    sched = make(14, 4, caching, max_num_seqs=6, max_num_batched_tokens=32, enable_chunked_prefill=chunked)
    seqs = run_engine(sched, requests)
    check_outputs(sched, requests, seqs)
    assert sched.num_preemptions > 0
    if caching:
        assert sched.block_manager.prefix_cache_hit_rate > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 10), st.lists(st.integers(1, 3), min_size=1, max_size=12), st.integers(1, 10)),
        min_size=1,
        max_size=8,
    ),
    block_size=st.integers(1, 4),
    spare_blocks=st.integers(0, 6),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(12, 24),
    chunked=st.booleans(),
    caching=st.booleans(),
    prefill_cap=st.one_of(st.none(), st.integers(1, 16)),
)
def test_random_workloads_match_solo_runs(
    reqs: list[tuple[int, list[int], int]],
    block_size: int,
    spare_blocks: int,
    max_num_seqs: int,
    budget: int,
    chunked: bool,
    caching: bool,
    prefill_cap: int | None,
) -> None:
    requests = [Request(a, p, m) for a, p, m in reqs]
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    num_blocks = -(-longest // block_size) + spare_blocks
    sched = make(
        num_blocks,
        block_size,
        caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        max_prefill_tokens=prefill_cap,
    )
    seqs = run_engine(sched, requests)
    check_outputs(sched, requests, seqs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 6), st.lists(st.integers(1, 3), min_size=1, max_size=6), st.integers(1, 6)),
        min_size=2,
        max_size=10,
    ),
    budget=st.integers(1, 7),
    max_num_seqs=st.integers(1, 6),
    spare_blocks=st.integers(0, 8),
    chunked=st.booleans(),
    prefill_cap=st.one_of(st.none(), st.integers(1, 5)),
)
def test_small_budgets_are_used_to_the_last_token(
    reqs: list[tuple[int, list[int], int]], budget: int, max_num_seqs: int, spare_blocks: int, chunked: bool,
    prefill_cap: int | None,
) -> None:
    # Budgets of a few tokens put the edge cases (one token left, a chunk exactly the rest) in most
    # steps; run_engine's check_budget_used looks at every step.
    if not chunked:
        reqs = [(a, p[:budget], m) for a, p, m in reqs]  # unchunked prompts must fit one step
    requests = [Request(a, p, m) for a, p, m in reqs]
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    sched = make(-(-longest // 2) + spare_blocks, 2, True, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=budget, enable_chunked_prefill=chunked, max_prefill_tokens=prefill_cap)
    check_outputs(sched, requests, run_engine(sched, requests))


# ---- policy examples -----------------------------------------------------------------------


def test_prefill_cap_staggers_a_burst_of_prompts_and_decodes_ride_along() -> None:
    # four 8-token prompts at once, a 64-token step budget but 12 prompt tokens a step: the first
    # prompt streams after one step instead of all four after one big step
    sched = make(64, 4, False, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens=12)
    seqs = [Sequence(str(i), list(range(1 + 10 * i, 9 + 10 * i)), SimpleNamespace(max_tokens=99)) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    plan = []
    for _ in range(4):
        out = sched.schedule()
        plan.append([(item.seq.request_id, item.num_new_tokens, item.produces_token) for item in out.scheduled])
        run_step(sched, out)
    assert plan == [
        [("0", 8, True), ("1", 4, False)],                   # 12 prompt tokens: 1's prompt is split
        [("0", 1, True), ("1", 4, True), ("2", 8, True)],    # 0's decode does not count against the 12
        [("0", 1, True), ("1", 1, True), ("2", 1, True), ("3", 8, True)],
        [("0", 1, True), ("1", 1, True), ("2", 1, True), ("3", 1, True)],
    ]
    # without the cap all four prompts share the first step
    sched = make(64, 4, False, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(4):
        sched.add(Sequence(str(i), list(range(1 + 10 * i, 9 + 10 * i)), SimpleNamespace(max_tokens=99)))
    assert [item.num_new_tokens for item in sched.schedule().scheduled] == [8, 8, 8, 8]


def test_prefill_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        make(max_prefill_tokens=0)


def run_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Sequence]:
    return sched.update(out, [token if item.produces_token else None for item in out.scheduled])


def test_new_requests_join_between_steps_and_decodes_go_first() -> None:
    sched = make(max_num_batched_tokens=8)
    a = Sequence("a", [1, 2, 3])
    sched.add(a)
    first = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in first.scheduled] == [(a, 3)]
    assert run_step(sched, first) == [a]
    b = Sequence("b", list(range(1, 11)))
    sched.add(b)
    second = sched.schedule()
    # a's decode token first, then b's prefill takes the rest of the 8-token budget
    assert [(i.seq, i.num_new_tokens) for i in second.scheduled] == [(a, 1), (b, 7)]
    assert second.num_batched_tokens == 8
    assert [i.produces_token for i in second.scheduled] == [True, False]


def test_chunked_prefill_yields_a_token_only_after_the_last_chunk() -> None:
    sched = make(max_num_batched_tokens=8)
    seq = Sequence("a", list(range(1, 21)))
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        produced = run_step(sched, out)
        assert produced == ([seq] if sum(chunks) == 20 else [])
    assert chunks == [8, 8, 4]
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 20


def test_update_rejects_tokens_that_do_not_match_the_schedule() -> None:
    sched = make(max_num_batched_tokens=8)
    sched.add(Sequence("a", list(range(1, 21))))
    out = sched.schedule()
    with pytest.raises(ValueError, match="None \\(non-final chunk\\)"):
        sched.update(out, [5])
    with pytest.raises(ValueError, match="1 scheduled"):
        sched.update(out, [])


def test_prompt_waits_for_budget_without_chunked_prefill() -> None:
    sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = Sequence("a", [1] * 5), Sequence("b", [2] * 5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a]  # b (5 tokens) does not fit in the 3 left
    run_step(sched, out)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(a, 1), (b, 5)]


def test_recompute_longer_than_budget_is_split_even_without_chunked_prefill() -> None:
    # Prefix caching off: otherwise b would hit its own freed blocks and recompute only 2 tokens.
    sched = make(10, 2, caching=False, max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = Sequence("a", [1] * 7), Sequence("b", [2] * 7)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)  # prefills beside a's decode; both decode until the 10 blocks run out
    while not (out := sched.schedule()).preempted:
        run_step(sched, out)
    assert out.preempted == [b] and b.num_tokens == 10  # now longer than the 8-token budget
    run_step(sched, out)
    sched.finish(a, "length")
    first = sched.schedule()
    assert [(i.seq, i.num_new_tokens, i.produces_token) for i in first.scheduled] == [(b, 8, False)]
    run_step(sched, first)
    second = sched.schedule()
    assert [(i.seq, i.num_new_tokens, i.produces_token) for i in second.scheduled] == [(b, 2, True)]


def test_max_num_seqs_is_respected() -> None:
    sched = make(max_num_seqs=2)
    seqs = [Sequence(str(i), [i + 1]) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == seqs[:2] and sched.num_waiting == 2
    run_step(sched, out)
    sched.finish(seqs[0], "stop")
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [seqs[1], seqs[2]]


def test_preemption_frees_newest_and_requeues_it_first() -> None:
    sched = make(num_blocks=6, block_size=2)
    a, b, c, d = (Sequence(name, [i, i + 1, i + 2]) for i, name in ((1, "a"), (4, "b"), (7, "c"), (10, "d")))
    for seq in (a, b, c, d):
        sched.add(seq)
    run_step(sched, sched.schedule())  # a, b and c fill all 6 blocks; d waits
    run_step(sched, sched.schedule())  # position 3 still fits in each second block
    out = sched.schedule()  # a needs a third block: c, the newest, is preempted; b then fits too
    assert out.preempted == [c] and sched.num_preemptions == 1
    assert [i.seq for i in out.scheduled] == [a, b]
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.token_ids[:3] == [7, 8, 9] and c.num_output_tokens == 2  # outputs kept for recompute
    assert list(sched.waiting) == [c, d]


def test_lone_sequence_larger_than_cache_is_a_configuration_error() -> None:
    sched = make(num_blocks=2, block_size=2)
    seq = Sequence("a", [1, 2, 3])
    sched.add(seq)
    run_step(sched, sched.schedule())
    run_step(sched, sched.schedule())
    with pytest.raises(RuntimeError, match="2 blocks of 2 tokens"):
        sched.schedule()


def test_waiting_head_is_not_overtaken_when_its_blocks_do_not_fit() -> None:
    sched = make(num_blocks=4, block_size=2)
    a = Sequence("a", [1, 2, 3])
    sched.add(a)
    run_step(sched, sched.schedule())  # a holds 2 blocks, 2 free
    big, small = Sequence("big", [5] * 7), Sequence("small", [6])
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a]
    assert list(sched.waiting) == [big, small]


def test_abort_frees_blocks_of_running_and_waiting_sequences() -> None:
    sched = make(num_blocks=8, block_size=2, max_num_seqs=1)
    running, waiting = Sequence("x", [1, 2, 3]), Sequence("x", [4, 5])
    other = Sequence("y", [6])
    for seq in (running, waiting, other):
        sched.add(seq)
    out = sched.schedule()
    assert sched.block_manager.num_free_blocks < 8
    aborted = sched.abort("x")
    assert set(map(id, aborted)) == {id(running), id(waiting)}
    for seq in aborted:
        assert seq.is_finished and seq.finish_reason == "abort" and seq.block_table == []
    assert sched.update(out, [9]) == []  # the in-flight step of an aborted sequence is ignored
    assert running.num_output_tokens == 0
    assert sched.block_manager.num_free_blocks == 8
    assert list(sched.waiting) == [other] and sched.has_unfinished()
    assert sched.abort("nope") == []


def test_prefix_cache_hit_reduces_scheduled_tokens() -> None:
    sched = make(block_size=4)
    prompt = list(range(1, 11))
    first = Sequence("a", prompt)
    sched.add(first)
    run_step(sched, sched.schedule())
    second = Sequence("b", prompt)
    sched.add(second)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(first, 1), (second, 2)]
    assert second.num_cached_tokens == 8


def test_fork_adds_a_running_child_sharing_blocks() -> None:
    sched = make(block_size=4)
    parent = Sequence("a", list(range(1, 7)))
    sched.add(parent)
    run_step(sched, sched.schedule())
    child, copies = sched.fork(parent)
    assert child.status is SequenceStatus.RUNNING and sched.num_running == 2
    assert child.block_table[0] == parent.block_table[0]
    assert copies == [(parent.block_table[1], child.block_table[1])]
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [parent, child]


def test_rejections_name_the_limits() -> None:
    sched = make(max_model_len=16)
    with pytest.raises(ValueError, match="17 tokens.*max_model_len=16"):
        sched.add(Sequence("a", [1] * 17))
    sched = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="9 tokens.*max_num_batched_tokens=8.*enable chunked prefill"):
        sched.add(Sequence("a", [1] * 9))
    sched = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="needs 3 KV blocks.*only 2"):
        sched.add(Sequence("a", [1] * 9))
    assert sched.num_waiting == 0
