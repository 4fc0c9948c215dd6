"""Chunked local attention over the plain paged_attention op (Llama 4's attention_chunk_size): a query at position p
sees only the keys at positions [p // C * C, p], its own aligned chunk of C positions.

No backend needs to implement it: each sequence's new tokens are cut at chunk boundaries into pieces, and each piece
becomes a sequence of its own whose context starts at its chunk's first position, which is the first slot of a block
when the block size divides C (its block-table row is the sequence's, shifted by whole blocks). The token order, the
slot mapping and the caches stay as they are, so the layer writes and reads the same cache as a full-attention one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.models.layers.attention_metadata import AttentionMetadata


def chunk_local_metadata(md: AttentionMetadata, chunk_size: int, block_size: int) -> AttentionMetadata:
    """`md` recut so that paged_attention over it is chunked attention with chunks of chunk_size positions.

    A decode batch (max_seqlen_q == 1) keeps one piece per sequence and reads nothing on the host (a device graph
    can hold it); a batch with longer queries is cut on the host. Raises ValueError when block_size does not divide
    chunk_size (a chunk would start inside a block: choose a block_size that divides attention_chunk_size)."""
    if chunk_size % block_size:
        raise ValueError(f"chunked attention needs the KV block size to divide attention_chunk_size={chunk_size}, "
                         f"got block size {block_size}; choose a block_size that divides it")
    if md.max_seqlen_q <= 1:
        starts = (md.seq_lens - 1).clamp(min=0) // chunk_size * chunk_size  # (B,) each query's chunk start
        rows = torch.arange(md.seq_lens.shape[0], device=md.seq_lens.device)
        return _pieces(md, md.cu_seqlens_q, md.seq_lens - starts, rows, starts // block_size, 1, chunk_size)
    bounds, lens = md.cu_seqlens_q.tolist(), md.seq_lens.tolist()
    cu, piece_lens, rows, first_blocks = [0], [], [], []
    for b, (lo, hi, end) in enumerate(zip(bounds[:-1], bounds[1:], lens, strict=True)):
        pos = end - (hi - lo)
        if pos == end:  # no new tokens (batch padding): kept as it is
            cu.append(cu[-1])
            piece_lens.append(end)
            rows.append(b)
            first_blocks.append(0)
        while pos < end:
            chunk_start = pos // chunk_size * chunk_size
            piece_end = min(end, chunk_start + chunk_size)
            cu.append(cu[-1] + piece_end - pos)
            piece_lens.append(piece_end - chunk_start)
            rows.append(b)
            first_blocks.append(chunk_start // block_size)
            pos = piece_end
    device = md.seq_lens.device

    def as_tensor(values: list[int], like: Tensor) -> Tensor:
        return torch.tensor(values, dtype=like.dtype, device=device)

    max_q = max(hi - lo for lo, hi in zip(cu[:-1], cu[1:], strict=True)) if len(cu) > 1 else 0
    return _pieces(md, as_tensor(cu, md.cu_seqlens_q), as_tensor(piece_lens, md.seq_lens),
                   torch.tensor(rows, device=device), torch.tensor(first_blocks, device=device), max_q, chunk_size)


def _pieces(md: AttentionMetadata, cu_seqlens_q: Tensor, seq_lens: Tensor, rows: Tensor, first_blocks: Tensor,
            max_seqlen_q: int, chunk_size: int) -> AttentionMetadata:
    """The metadata of P pieces: cu_seqlens_q (P+1,), seq_lens (P,) counted from each piece's chunk start, rows (P,)
    the sequence of each, first_blocks (P,) the index in that sequence's block table of its chunk's first block."""
    width = md.block_tables.shape[1]
    columns = (first_blocks[:, None] + torch.arange(width, device=first_blocks.device)).clamp_(max=width - 1)
    block_tables = md.block_tables[rows].gather(1, columns.to(torch.int64))  # entries past a context are never read
    return AttentionMetadata(slot_mapping=md.slot_mapping, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens.to(
        md.seq_lens.dtype), block_tables=block_tables, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=min(md.max_seqlen_k, chunk_size))


class ChunkLocalView:
    """One forward's chunk-local metadata, computed once and shared by every chunked layer of a model: the view of
    the last AttentionMetadata asked for (held, so its identity cannot be reused by another batch's)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._source: AttentionMetadata | None = None
        self._view: AttentionMetadata | None = None

    def of(self, md: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """chunk_local_metadata(md, chunk_size, block_size), reused while md is the same object; a decode batch's is
        recomputed each call (device ops only: a graph captured around it must hold them)."""
        if md.max_seqlen_q <= 1:
            return chunk_local_metadata(md, self.chunk_size, block_size)
        if md is not self._source:
            self._view = chunk_local_metadata(md, self.chunk_size, block_size)
            self._source = md
        return self._view
