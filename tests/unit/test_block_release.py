"""BlockManager.take_released: which free blocks' KV memory may go back to the OS, and never one in use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.core.block_manager import BlockManager
from flashllm.core.sequence import Sequence

BLOCK = 4


def run_prompt(bm: BlockManager, prompt: list[int]) -> Sequence:
    """Admit a prompt, compute all of it, commit (full blocks join the prefix cache)."""
    seq = Sequence("r", prompt)
    bm.allocate_prompt(seq)
    n = seq.num_uncomputed_tokens
    bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)
    return seq


def test_untouched_blocks_are_not_resident_and_nothing_is_released_before_a_free():
    bm = BlockManager(16, BLOCK)
    assert bm.num_resident_blocks == 0 and bm.take_released() == []
    seq = run_prompt(bm, list(range(10)))  # 3 blocks: 2 full (cached), 1 partial
    table = list(seq.block_table)
    assert bm.num_resident_blocks == 3 and bm.take_released() == []
    bm.free(seq)
    # the partial block holds nothing a later prompt can reuse: released; the cached full ones stay
    assert bm.take_released() == [table[-1]]
    assert bm.num_resident_blocks == 2 and bm.take_released() == []


def test_without_prefix_caching_every_freed_block_is_released():
    bm = BlockManager(16, BLOCK, enable_prefix_caching=False)
    a, b = run_prompt(bm, list(range(10))), run_prompt(bm, list(range(100, 105)))
    held_a, held_b = list(a.block_table), list(b.block_table)
    bm.free(a)
    assert bm.take_released() == sorted(held_a)
    assert bm.num_resident_blocks == len(held_b)


def test_retain_cached_keeps_the_most_recently_freed_and_forgets_the_rest():
    bm = BlockManager(32, BLOCK)
    old = run_prompt(bm, list(range(9)))  # 2 cached blocks + 1 partial
    new = run_prompt(bm, list(range(50, 59)))
    partials = sorted([old.block_table[-1], new.block_table[-1]])
    bm.free(old)
    bm.free(new)
    assert bm.take_released() == partials
    kept_hits = bm.num_prefix_hit_tokens(Sequence("n", list(range(50, 59))))
    released = bm.take_released(retain_cached=2)
    assert len(released) == 2 and bm.num_resident_blocks == 2
    # the newer prompt's prefix survives, the older one's is forgotten (its blocks were handed back)
    assert bm.num_prefix_hit_tokens(Sequence("n", list(range(50, 59)))) == kept_hits == 2 * BLOCK
    assert bm.num_prefix_hit_tokens(Sequence("o", list(range(9)))) == 0
    assert bm.take_released(retain_cached=0) != [] and bm.num_resident_blocks == 0 and bm.num_cached_blocks == 0


def test_a_block_reallocated_before_the_take_is_not_released():
    bm = BlockManager(4, BLOCK, enable_prefix_caching=False)
    a = run_prompt(bm, list(range(3)))
    block = a.block_table[0]
    bm.free(a)
    b = run_prompt(bm, list(range(3)))  # the freed block is at the front of the queue: handed out again
    assert b.block_table == [block]
    assert bm.take_released() == []
    assert bm.num_resident_blocks == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "free", "take", "idle", "reset"]), st.integers(0, 30)),
                max_size=60), st.booleans())
def test_no_block_in_use_is_ever_released(ops, caching):
    """Random admits (prompts sharing prefixes), frees, takes and prefix-cache resets: every released
    block is free, every block in use is resident, and a released block is not resident."""
    bm = BlockManager(24, BLOCK, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for op, arg in ops:
        if op == "add":
            prompt = [arg % 3] * (arg % 5) + list(range(arg, arg + 1 + arg % 9))
            seq = Sequence("s", prompt)
            if bm.can_allocate(seq, len(prompt)):
                live.append(run_prompt(bm, prompt))
        elif op == "free" and live:
            bm.free(live.pop(arg % len(live)))
        elif op == "reset":
            bm.reset_prefix_cache()
        else:
            released = bm.take_released(retain_cached=arg % 4 if op == "idle" else None)
            assert released == sorted(set(released))
            assert all(bm.blocks[b].ref_count == 0 and bm.blocks[b].hash is None for b in released)
            assert not set(released) & bm._resident
        in_use = {b for seq in live for b in seq.block_table}
        assert in_use <= bm._resident
