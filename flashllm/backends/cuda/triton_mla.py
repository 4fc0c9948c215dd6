"""Triton latent_attention (MLA): a latent-row store, then attention in the latent space over the paged cache.

Both of the op's forms run in the absorbed order here: W_UK is folded into the queries and W_UV applied
to the weighted sum of latents with torch matmuls, and the kernel is multi-query attention of every head
over one shared (L + R)-wide key row per token (values: its first L features), online softmax over tiles
of keys. The naive order would materialize per-head keys and values of the whole context, which is what
MLA exists to avoid on a GPU; the two compute the same function (the op's contract) to rounding.
No host sync: each token's sequence and position are found on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last
from flashllm.ops.latent_attention import check_inputs

BLOCK_H = 16  # query heads per program (tl.dot needs 16 rows)
BLOCK_N = 32  # keys per tile


@triton.jit
def _store_latent_kernel(latent_ptr, cache_ptr, slot_ptr, stride_lt, stride_cb, stride_cs, width,
                         BLOCK_SIZE: tl.constexpr, W_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, W_PAD)
        row = tl.load(latent_ptr + t * stride_lt + cols, mask=cols < width)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + cols
        tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=cols < width)


@triton.jit
def _mla_kernel(q_ptr, cache_ptr, tables_ptr, seq_ptr, len_ptr, out_ptr,
                stride_qt, stride_qh, stride_cb, stride_cs, stride_tb, stride_ot, stride_oh,
                num_heads, rank, rope, scale,
                BLOCK_SIZE: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    lat_cols = tl.arange(0, L_PAD)
    rope_cols = tl.arange(0, R_PAD)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + lat_cols[None, :], mask=head_ok[:, None] & (lat_cols[None, :] < rank), other=0.0)
    q_pe = tl.load(q_row + rank + rope_cols[None, :], mask=head_ok[:, None] & (rope_cols[None, :] < rope),
                   other=0.0)
    seq = tl.load(seq_ptr + t)
    context = tl.load(len_ptr + t)  # keys this token sees: its position + 1
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, L_PAD), tl.float32)
    for start in range(0, context, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < context
        block = tl.load(tables_ptr + seq * stride_tb + keys // BLOCK_SIZE, mask=key_ok, other=0)
        row = cache_ptr + block[:, None] * stride_cb + (keys % BLOCK_SIZE)[:, None] * stride_cs
        c = tl.load(row + lat_cols[None, :], mask=key_ok[:, None] & (lat_cols[None, :] < rank), other=0.0)
        k_pe = tl.load(row + rank + rope_cols[None, :], mask=key_ok[:, None] & (rope_cols[None, :] < rope),
                       other=0.0)
        c, k_pe = c.to(tl.float32), k_pe.to(tl.float32)  # fp32 math, as the op says (queries are fp32)
        scores = tl.dot(q_lat, tl.trans(c), input_precision="ieee") + tl.dot(q_pe, tl.trans(k_pe),
                                                                           input_precision="ieee")
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + lat_cols[None, :]
    tl.store(dst, out, mask=head_ok[:, None] & (lat_cols[None, :] < rank))


def _token_positions(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token, keys it sees = position + 1), each (T,) int32, on the device; padding
    tokens past cu_seqlens_q[-1] see one key of the last sequence."""
    ends = cu_seqlens_q[1:].long()
    token = torch.arange(num_tokens, device=cu_seqlens_q.device)
    seq = (token[:, None] >= ends[None, :]).sum(dim=-1)
    real = seq < ends.shape[0]
    seq = seq.clamp(max=ends.shape[0] - 1)
    keys = seq_lens.long().index_select(0, seq) - ends.index_select(0, seq) + token + 1
    return seq.to(torch.int32), torch.where(real, keys, torch.ones_like(keys)).to(torch.int32)


def latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    absorbed: bool = True,
) -> torch.Tensor:
    """The op's contract (flashllm.ops.latent_attention); fp32 math, (T, H, Dv) in q.dtype."""
    if kv_cache.dim() != 3 or not kv_cache.is_floating_point() or kv_cache.itemsize == 1:
        check_inputs(q, latent, kv_cache, kv_b_weight, slot_mapping, [], [])  # raises, saying what was expected
    unit_stride_last("latent_attention", latent=latent, kv_cache=kv_cache)
    num_tokens, num_heads = q.shape[:2]
    rank = kv_b_weight.shape[2]
    width = kv_cache.shape[-1]
    rope = width - rank
    nope = q.shape[-1] - rope
    block_size = kv_cache.shape[1]
    if num_tokens:
        _store_latent_kernel[(num_tokens,)](
            latent, kv_cache, slot_mapping, latent.stride(0), kv_cache.stride(0), kv_cache.stride(1), width,
            BLOCK_SIZE=block_size, W_PAD=pow2(width), num_warps=4, **LAUNCH_OPTIONS,
        )
    w = kv_b_weight.float()
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # (H, Dn, L), (H, Dv, L)
    qf = q.float()
    q_latent = torch.matmul(qf[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # (T, H, L)
    query = torch.cat((q_latent, qf[..., nope:]), dim=-1).contiguous()  # (T, H, L + R) fp32
    out_latent = torch.empty(num_tokens, num_heads, rank, dtype=torch.float32, device=q.device)
    seq, context = _token_positions(cu_seqlens_q, seq_lens, num_tokens)
    if num_tokens:
        _mla_kernel[(num_tokens, triton.cdiv(num_heads, BLOCK_H))](
            query, kv_cache, block_tables, seq, context, out_latent,
            query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
            out_latent.stride(0), out_latent.stride(1), num_heads, rank, rope, scale,
            BLOCK_SIZE=block_size, L_PAD=pow2(rank, 16), R_PAD=pow2(rope, 16), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
            num_warps=4, **LAUNCH_OPTIONS,
        )
    out = torch.matmul(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (T, H, Dv)
    return out.to(q.dtype)
