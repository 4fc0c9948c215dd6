"""Chunked local attention over the plain paged_attention op (layers/chunked_attention.py): the recut metadata gives
every query exactly the keys of its own aligned chunk, for prefills across chunks, chunks after a cached prefix,
decodes and padded sequences, on the host path and the decode path alike."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.chunked_attention import ChunkLocalView, chunk_local_metadata
from flashllm.ops.paged_attention import paged_attention

BLOCK, CHUNK, HEADS, KV_HEADS, DIM = 4, 8, 4, 2, 8


def _batch(shapes: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, ...]:
    """Random q and a paged cache for sequences of (q_len, seq_len), each on its own shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-seq_len // BLOCK) for _, seq_len in shapes)
    order = torch.randperm(len(shapes) * width, generator=gen).int()
    block_tables = order.view(len(shapes), width)
    k_cache = torch.randn(len(shapes) * width, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    q = torch.randn(sum(q_len for q_len, _ in shapes), HEADS, DIM, generator=gen)
    return q, k_cache, v_cache, block_tables


def _metadata(shapes: list[tuple[int, int]], block_tables: torch.Tensor) -> AttentionMetadata:
    q_lens = [q_len for q_len, _ in shapes]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), cu_seqlens_q=cu,
                             seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32),
                             block_tables=block_tables, max_seqlen_q=max(q_lens),
                             max_seqlen_k=max(s for _, s in shapes))


def _expected(q, k_cache, v_cache, block_tables, shapes) -> torch.Tensor:
    """Each query over the keys of its chunk up to itself, from the gathered context, by a dense mask."""
    out, start = torch.zeros_like(q), 0
    for b, (q_len, seq_len) in enumerate(shapes):
        if q_len == 0:
            continue
        slots = torch.arange(seq_len)
        blocks = block_tables[b].long()[slots // BLOCK]
        k = k_cache[blocks, slots % BLOCK].repeat_interleave(HEADS // KV_HEADS, dim=1)  # (seq_len, Hq, D)
        v = v_cache[blocks, slots % BLOCK].repeat_interleave(HEADS // KV_HEADS, dim=1)
        q_pos = slots[seq_len - q_len:]
        visible = (slots[None, :] <= q_pos[:, None]) & (slots[None, :] // CHUNK == q_pos[:, None] // CHUNK)
        scores = torch.einsum("qhd,shd->hqs", q[start:start + q_len], k) * DIM**-0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", probs, v)
        start += q_len
    return out


@pytest.mark.parametrize("shapes", [
    [(13, 13), (6, 19), (1, 17), (0, 5), (1, 16), (20, 20)],  # prefill across chunks, a chunk after a prefix, padding
    [(1, 1), (1, 8), (1, 9), (1, 24), (0, 3)],  # decodes at and past chunk edges: the device-only path
    [(8, 16), (9, 9)],  # pieces ending exactly at a chunk edge
])
def test_each_query_sees_only_its_own_chunk(shapes) -> None:
    q, k_cache, v_cache, block_tables = _batch(shapes, seed=len(shapes))
    md = chunk_local_metadata(_metadata(shapes, block_tables), CHUNK, BLOCK)
    out = paged_attention(q, k_cache, v_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, DIM**-0.5)
    torch.testing.assert_close(out, _expected(q, k_cache, v_cache, block_tables, shapes), rtol=1e-5, atol=1e-5)
    assert md.max_seqlen_k <= CHUNK and int(md.cu_seqlens_q[-1]) == q.shape[0]


def test_a_block_size_that_does_not_divide_the_chunk_is_refused() -> None:
    shapes = [(3, 3)]
    with pytest.raises(ValueError, match="block size to divide attention_chunk_size=8, got block size 3"):
        chunk_local_metadata(_metadata(shapes, _batch(shapes, 0)[3]), CHUNK, 3)


def test_one_forward_shares_its_recut_prefill_metadata() -> None:
    shapes = [(13, 13), (1, 9)]
    md, view = _metadata(shapes, _batch(shapes, 1)[3]), ChunkLocalView(CHUNK)
    assert view.of(md, BLOCK) is view.of(md, BLOCK)
    assert view.of(_metadata(shapes, md.block_tables), BLOCK) is not view.of(md, BLOCK)
