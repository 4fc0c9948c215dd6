"""Recurrent-state slots: the block manager hands one per sequence, and causal_conv1d carries a sequence's
inputs across prefill chunks and decodes exactly as one pass over the whole sequence computes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashllm.core.block_manager import BlockManager, NoFreeBlocksError
from flashllm.core.sequence import Sequence
from flashllm.models.layers.recurrent import causal_conv1d, state_spans
from flashllm.ops.attention_metadata import AttentionMetadata

CHANNELS, WIDTH = 6, 4


def _metadata(q_lens: list[int], contexts: list[int], slots: list[int] | None) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(contexts, q_lens, strict=True)], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64), cu_seqlens_q=cu,
                             seq_lens=seq_lens, block_tables=torch.zeros(len(q_lens), 1, dtype=torch.int32),
                             max_seqlen_q=max(q_lens), max_seqlen_k=int(seq_lens.max()),
                             state_slots=None if slots is None else torch.tensor(slots, dtype=torch.int64))


def _whole(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One sequence (L, C) convolved causally from zeros: the definition."""
    padded = F.pad(x.t(), (WIDTH - 1, 0))
    return F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=CHANNELS)[0].t()


def test_conv_chunks_and_decodes_of_interleaved_sequences_equal_whole_passes() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS)
    a, b = torch.randn(9, CHANNELS), torch.randn(5, CHANNELS)
    state = torch.full((3, CHANNELS, WIDTH - 1), 7.0)  # stale contents: fresh sequences must ignore them
    # step 1: a's first 2 tokens (shorter than the window) and b's whole prompt, in slots 2 and 0
    first = causal_conv1d(torch.cat([a[:2], b]), weight, bias, state, state_spans(_metadata([2, 5], [0, 0], [2, 0])))
    # step 2: a's next 4 tokens as a later chunk; step 3 onwards: one-token decodes of both
    second = causal_conv1d(a[2:6], weight, bias, state, state_spans(_metadata([4], [2], [2])))
    rows = [causal_conv1d(a[t:t + 1], weight, bias, state, state_spans(_metadata([1], [t], [2]))) for t in range(6, 9)]
    got_a = torch.cat([first[:2], second, *rows])
    torch.testing.assert_close(got_a, _whole(a, weight, bias))
    torch.testing.assert_close(first[2:], _whole(b, weight, bias))
    torch.testing.assert_close(state[2], a[-(WIDTH - 1):].t())
    torch.testing.assert_close(state[1], torch.full((CHANNELS, WIDTH - 1), 7.0))  # untouched


def test_vectorized_decode_equals_sequence_walk_and_fresh_rows_ignore_stale_slots() -> None:
    torch.manual_seed(1)
    weight, bias = torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS)
    prompts = [torch.randn(n, CHANNELS) for n in (3, 1, 6)]
    state = torch.zeros(4, CHANNELS, WIDTH - 1)
    causal_conv1d(torch.cat(prompts[0:1] + prompts[2:]), weight, bias, state,
                  state_spans(_metadata([3, 6], [0, 0], [1, 3])))
    state[0] = 5.0  # a stale slot the one-token prompt in slot 0 must not read
    nxt = torch.randn(3, CHANNELS)
    # a decode batch: two continuing sequences and a fresh one-token prompt
    out = causal_conv1d(torch.stack([nxt[0], prompts[1][0], nxt[2]]), weight, bias, state,
                        state_spans(_metadata([1, 1, 1], [3, 0, 6], [1, 0, 3])))
    torch.testing.assert_close(out[0], _whole(torch.cat([prompts[0], nxt[:1]]), weight, bias)[-1])
    torch.testing.assert_close(out[1], _whole(prompts[1], weight, bias)[-1])
    torch.testing.assert_close(out[2], _whole(torch.cat([prompts[2], nxt[2:]]), weight, bias)[-1])


def test_a_pass_without_slots_starts_from_zeros_and_keeps_nothing() -> None:
    torch.manual_seed(2)
    weight, bias, x = torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS), torch.randn(5, CHANNELS)
    state = torch.full((1, CHANNELS, WIDTH - 1), 3.0)
    out = causal_conv1d(x, weight, bias, state, state_spans(_metadata([5], [0], None)))
    torch.testing.assert_close(out, _whole(x, weight, bias))
    assert torch.equal(state, torch.full((1, CHANNELS, WIDTH - 1), 3.0))


def test_block_manager_gives_each_sequence_its_own_slot_until_freed() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False, num_state_slots=2)
    first, second, third = (Sequence(str(i), [1, 2, 3]) for i in range(3))
    for seq in (first, second):
        assert bm.can_allocate(seq, 3)
        bm.allocate_prompt(seq)
    assert {first.state_slot, second.state_slot} == {0, 1}
    assert not bm.can_allocate(third, 3)  # blocks are free, slots are not
    with pytest.raises(NoFreeBlocksError, match="recurrent-state slot"):
        bm.allocate_prompt(third)
    slot = first.state_slot
    bm.free(first)
    assert first.state_slot == -1 and bm.can_allocate(third, 3)
    bm.allocate_prompt(third)
    assert third.state_slot == slot
    with pytest.raises(ValueError, match="cannot fork"):
        bm.fork(second, Sequence("4", [1, 2, 3]))
    with pytest.raises(ValueError, match="prefix caching off"):
        BlockManager(8, 4, enable_prefix_caching=True, num_state_slots=2)
