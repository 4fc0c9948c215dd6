"""BlockManager: ref counts, prefix caching by chained hashes, eviction order, fork."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flashllm.core.block_manager import BlockManager, NoFreeBlocksError
from flashllm.core.sequence import Sequence


def chained_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The documented hash chain, computed independently: sha256(parent digest + int64 LE tokens)."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block)).digest()
        hashes.append(parent)
    return hashes


def run_prompt(bm: BlockManager, prompt: list[int], compute: int | None = None) -> Sequence:
    """Admit a prompt, compute `compute` more tokens (default: all uncomputed), commit."""
    seq = Sequence("r", prompt)
    bm.allocate_prompt(seq)
    n = seq.num_uncomputed_tokens if compute is None else compute
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)
    return seq


# ---- examples ------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "expected_hit_blocks"), [(0, 2), (1, 3)])
def test_second_request_hits_prefix_but_leaves_one_token(extra: int, expected_hit_blocks: int) -> None:
    bs = 4
    prompt = list(range(100, 112)) + list(range(extra))  # 3 full blocks (+ 1 token)
    bm = BlockManager(num_blocks=16, block_size=bs)
    first = run_prompt(bm, prompt)
    second = Sequence("r2", prompt)
    assert bm.num_prefix_hit_tokens(second) == expected_hit_blocks * bs
    bm.allocate_prompt(second)
    assert second.num_computed_tokens == second.num_cached_tokens == expected_hit_blocks * bs
    assert second.num_uncomputed_tokens >= 1
    assert second.block_table == first.block_table[:expected_hit_blocks]
    for block_id in second.block_table:
        assert bm.blocks[block_id].ref_count == 2
    assert second.block_hashes == chained_hashes(prompt, bs)[:expected_hit_blocks]


def test_hit_survives_free_until_evicted_and_takes_block_back_from_free_pool() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    first = run_prompt(bm, prompt)
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 8
    second = Sequence("r", prompt)
    bm.allocate_prompt(second)
    assert second.block_table == table[:2]
    assert bm.num_free_blocks == 6
    assert not set(second.block_table) & set(bm.free_block_ids)


def test_hash_is_chained_not_per_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    first = run_prompt(bm, [1, 2, 3, 4, 9])
    # The chain, not just each block's own tokens: the same two blocks in the other order sit at
    # other positions after another prefix, so a hash of a block's tokens alone would hit both.
    assert bm.num_prefix_hit_tokens(Sequence("r", [3, 4, 1, 2, 9])) == 0
    # A shared second block after a different first one: the lookup must miss from the start.
    assert bm.num_prefix_hit_tokens(Sequence("r", [7, 7, 3, 4, 9])) == 0
    assert bm.num_prefix_hit_tokens(Sequence("r", [1, 2, 8, 8, 9])) == 2
    # And the digests are the documented chain (an independent computation), which a hash of the
    # block's position and tokens alone would not give either.
    assert first.block_hashes == chained_hashes([1, 2, 3, 4, 9], 2)
    assert first.block_hashes[1] != hashlib.sha256(struct.pack("<2q", 3, 4)).digest()


def test_only_computed_full_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    seq = run_prompt(bm, prompt, compute=6)  # block 0 computed, block 1 half computed
    assert bm.num_cached_blocks == 1
    assert bm.num_prefix_hit_tokens(Sequence("r", prompt)) == 4
    bm.append_slots(seq, 4)
    seq.num_computed_tokens += 4
    bm.commit(seq)
    assert bm.num_cached_blocks == 2
    assert bm.num_prefix_hit_tokens(Sequence("r", prompt)) == 8


@pytest.mark.parametrize("free_a_first", [True, False])
def test_eviction_takes_least_recently_freed_tail_first(free_a_first: bool) -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = run_prompt(bm, [1, 1, 2, 2])
    b = run_prompt(bm, [3, 3, 4, 4])
    for seq in (a, b) if free_a_first else (b, a):
        bm.free(seq)
    older, newer = ([1, 1, 2, 2], [3, 3, 4, 4]) if free_a_first else ([3, 3, 4, 4], [1, 1, 2, 2])
    run_prompt(bm, [9, 9])  # needs one block: evicts the older chain's tail
    assert bm.num_prefix_hit_tokens(Sequence("r", older + [0])) == 2
    assert bm.num_prefix_hit_tokens(Sequence("r", newer + [0])) == 4
    run_prompt(bm, [8])  # next eviction: the older chain's head
    assert bm.num_prefix_hit_tokens(Sequence("r", older + [0])) == 0
    assert bm.num_prefix_hit_tokens(Sequence("r", newer + [0])) == 4


def test_blocks_without_hash_are_reused_before_cached_ones() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    cached = run_prompt(bm, [1, 2])  # one full, cached block
    partial = run_prompt(bm, [5])  # one partial block: nothing worth keeping
    bm.free(cached)
    bm.free(partial)  # freed last, yet handed out first: reusing it loses no cached prefix
    run_prompt(bm, [7])
    assert bm.num_prefix_hit_tokens(Sequence("r", [1, 2, 9])) == 2


def test_can_allocate_counts_hit_blocks_taken_from_free_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.free(run_prompt(bm, [1, 2, 3, 4, 5]))  # 2 cached blocks + 1 partial, all 4 free again
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 7])
    assert bm.num_prefix_hit_tokens(seq) == 4
    # 2 hit blocks leave the free pool, positions 4..6 need 2 new ones: 4 of 4, but not 3 of 4.
    assert bm.can_allocate(seq, 3)
    bm.allocate_prompt(seq)
    assert bm.can_append(seq, 3)
    bm.append_slots(seq, 3)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(Sequence("r", [1, 2, 3, 4, 5, 6, 7]), 3)


def test_append_slots_out_of_blocks_raises_and_allocates_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = Sequence("r", [1, 2, 3, 4, 5])
    bm.allocate_prompt(seq)
    assert not bm.can_append(seq, 5)
    with pytest.raises(NoFreeBlocksError, match="needs 3 more KV blocks"):
        bm.append_slots(seq, 5)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_fork_shares_full_blocks_and_copies_partial_one() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = run_prompt(bm, list(range(6)))  # block 0 full, block 1 holds 2 of 4
    child = parent.clone()
    copies = bm.fork(parent, child)
    assert len(child.block_table) == 2
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] not in parent.block_table
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert bm.blocks[parent.block_table[0]].ref_count == 2
    assert bm.blocks[child.block_table[1]].ref_count == 1
    assert child.num_computed_tokens == 6 and child.token_ids == parent.token_ids
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 6


def test_fork_on_block_boundary_copies_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = run_prompt(bm, list(range(8)))
    child = parent.clone()
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table


def test_fork_without_free_block_raises_before_touching_refs() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = run_prompt(bm, list(range(6)))
    with pytest.raises(NoFreeBlocksError):
        bm.fork(parent, parent.clone())
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [1, 1]


def test_hit_rate_reset_and_disabled_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    run_prompt(bm, [1, 2, 3, 4, 5])  # 2 eligible blocks, 0 hits
    run_prompt(bm, [1, 2, 3, 4, 5])  # 2 eligible, 2 hits
    run_prompt(bm, [1, 2, 7, 7, 7, 7, 7])  # 3 eligible, 1 hit
    assert bm.prefix_cache_hit_rate == pytest.approx(3 / 7)
    bm.reset_prefix_cache()
    assert bm.prefix_cache_hit_rate == 0.0 and bm.num_cached_blocks == 0
    assert bm.num_prefix_hit_tokens(Sequence("r", [1, 2, 3, 4, 5])) == 0

    off = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=False)
    run_prompt(off, [1, 2, 3, 4, 5])
    again = run_prompt(off, [1, 2, 3, 4, 5])
    assert again.num_cached_tokens == 0 and off.num_cached_blocks == 0


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(num_blocks=0, block_size=16)
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = run_prompt(bm, [1, 2, 3])
    with pytest.raises(ValueError, match="free\\(seq\\) first"):
        bm.allocate_prompt(seq)


# ---- state machine -------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / commit / fork / free over a small pool, against a model of
    what each KV slot holds: slot content = the token prefix whose last token's KV it stores."""

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.seqs: list[Sequence] = []
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {b: {} for b in range(num_blocks)}
        self.next_token = 0

    def _compute(self, seq: Sequence, n: int) -> None:
        """Append slots for n tokens, 'run the model' (write their KV), advance, commit."""
        self.bm.append_slots(seq, n)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block_id = seq.block_table[pos // self.bs]
            assert self.bm.blocks[block_id].ref_count == 1, "writing into a shared block"
            self.kv[block_id][pos % self.bs] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += n
        self.bm.commit(seq)
        if seq.num_uncomputed_tokens == 0:
            self.next_token = (self.next_token + 1) % 2
            seq.append_token(self.next_token)

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=12), n=st.integers(1, 6))
    def admit(self, prompt: list[int], n: int) -> None:
        seq = Sequence("r", prompt)
        hit = self.bm.num_prefix_hit_tokens(seq)
        n = min(n, seq.num_tokens - hit)
        fits = self.bm.can_allocate(seq, n)
        self.bm.allocate_prompt(seq)
        assert seq.num_computed_tokens == hit == seq.num_cached_tokens
        assert hit % self.bs == 0 and hit < seq.num_tokens
        self.seqs.append(seq)
        assert self.bm.can_append(seq, n) == fits
        if fits:
            self._compute(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), n=st.integers(1, 6))
    def step(self, index: int, n: int) -> None:
        seq = self.seqs[index % len(self.seqs)]
        n = min(n, seq.num_uncomputed_tokens)
        if self.bm.can_append(seq, n):
            self._compute(seq, n)
        else:
            table, num_free = list(seq.block_table), self.bm.num_free_blocks
            with pytest.raises(NoFreeBlocksError):
                self.bm.append_slots(seq, n)
            assert seq.block_table == table and self.bm.num_free_blocks == num_free

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq = self.seqs.pop(index % len(self.seqs))
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    @precondition(lambda self: self.seqs and len(self.seqs) < 6)
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        parent = self.seqs[index % len(self.seqs)]
        child = parent.clone()
        if parent.num_computed_tokens % self.bs and self.bm.num_free_blocks == 0:
            with pytest.raises(NoFreeBlocksError):
                self.bm.fork(parent, child)
            return
        for src, dst in self.bm.fork(parent, child):
            assert src in parent.block_table and self.bm.blocks[dst].ref_count == 1
            self.kv[dst] = dict(self.kv[src])
        self.seqs.append(child)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def ref_counts_match_owners(self) -> None:
        owners: dict[int, int] = {}
        for seq in self.seqs:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) == -(-seq.num_computed_tokens // self.bs)
            for block_id in seq.block_table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == owners.get(block.block_id, 0)
        free = self.bm.free_block_ids
        assert len(set(free)) == len(free) == self.bm.num_free_blocks
        assert set(free) == {b.block_id for b in self.bm.blocks if b.ref_count == 0}
        assert len(free) + len(owners) == self.bm.num_total_blocks

    @invariant()
    def shared_blocks_are_full_and_computed(self) -> None:
        for seq in self.seqs:
            for i, block_id in enumerate(seq.block_table):
                if self.bm.blocks[block_id].ref_count > 1:
                    assert seq.num_computed_tokens >= (i + 1) * self.bs

    @invariant()
    def kv_cache_holds_each_sequences_prefix(self) -> None:
        for seq in self.seqs:
            for pos in range(seq.num_computed_tokens):
                slot_content = self.kv[seq.block_table[pos // self.bs]].get(pos % self.bs)
                assert slot_content == tuple(seq.token_ids[: pos + 1])
            expected = chained_hashes(seq.token_ids, self.bs)
            assert seq.block_hashes == expected[: len(seq.block_hashes)]

    @invariant()
    def cached_hash_describes_block_content(self) -> None:
        hashed = [b for b in self.bm.blocks if b.hash is not None]
        assert len(hashed) == self.bm.num_cached_blocks
        assert len({b.hash for b in hashed}) == len(hashed)
        for block in hashed:
            prefix = self.kv[block.block_id][self.bs - 1]  # full block: its last slot has the prefix
            assert chained_hashes(list(prefix), self.bs)[-1] == block.hash

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.seqs:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
