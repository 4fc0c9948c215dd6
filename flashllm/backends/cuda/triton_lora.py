"""Triton batched LoRA (punica-style BGMV): lora_shrink and lora_expand, each row reading its own adapter slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last

BLOCK_K = 128
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, h_ptr, K, R, stride_x, stride_al, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    raw = tl.load(idx_ptr + row)
    slot = tl.maximum(raw, 0).to(tl.int64)  # a -1 row reads slot 0 (in bounds) and is zeroed below
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        a_mask = (ranks[:, None] < R) & (cols[None, :] < K)
        a = tl.load(a_ptr + slot * stride_al + ranks[:, None] * stride_ar + cols[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    acc = tl.where(tl.zeros((BLOCK_R,), dtype=tl.int64) + raw >= 0, acc, 0.0)
    tl.store(h_ptr + row * stride_h + ranks, acc.to(h_ptr.dtype.element_ty), mask=ranks < R)


@triton.jit
def _expand_kernel(out_ptr, h_ptr, b_ptr, idx_ptr, N, R, offset, stride_out, stride_h0, stride_h1,
                   stride_bl, stride_bn, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    raw = tl.load(idx_ptr + row)
    slot = tl.maximum(raw, 0).to(tl.int64)  # a -1 row reads slot 0 (in bounds) and stores nothing
    ranks = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + row * stride_h0 + ranks * stride_h1, mask=ranks < R, other=0.0).to(tl.float32)
    b_mask = (cols[:, None] < N) & (ranks[None, :] < R)
    b = tl.load(b_ptr + slot * stride_bl + cols[:, None] * stride_bn + ranks[None, :], mask=b_mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    out_mask = (cols < N) & (tl.zeros((BLOCK_N,), dtype=tl.int64) + raw >= 0)  # rows without an adapter: no write
    ptrs = out_ptr + row * stride_out + offset + cols
    base = tl.load(ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (base + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_indices: torch.Tensor) -> torch.Tensor:
    """h (T, R) in x.dtype = x @ A_slot^T per row (fp32 sums), zero for -1 rows (see the op spec)."""
    unit_stride_last("lora_shrink", x=x, lora_a=lora_a)
    tokens, k = x.shape
    rank = lora_a.shape[1]
    h = torch.empty((tokens, rank), dtype=x.dtype, device=x.device)
    if tokens:
        indices = lora_indices.contiguous()
        _shrink_kernel[(tokens,)](x, lora_a, indices, h, k, rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                                  h.stride(0), BLOCK_R=pow2(rank, 16), BLOCK_K=min(BLOCK_K, pow2(k, 16)),
                                  num_warps=4, **LAUNCH_OPTIONS)
    return h


def lora_expand(out: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
                offset: int) -> torch.Tensor:
    """out[:, offset:offset + N] += h @ B_slot^T per row, -1 rows untouched (see the op spec)."""
    n, rank = lora_b.shape[1], lora_b.shape[2]
    if offset < 0 or offset + n > out.shape[1]:
        raise ValueError(f"lora_expand: slice [{offset}, {offset + n}) does not fit out's {out.shape[1]} columns")
    unit_stride_last("lora_expand", out=out, lora_b=lora_b)
    tokens = out.shape[0]
    if tokens and n:
        indices = lora_indices.contiguous()
        block_n = min(BLOCK_N, pow2(n, 16))
        grid = (tokens, triton.cdiv(n, block_n))
        _expand_kernel[grid](out, h, lora_b, indices, n, rank, offset, out.stride(0), h.stride(0), h.stride(1),
                             lora_b.stride(0), lora_b.stride(1), BLOCK_R=pow2(rank, 16), BLOCK_N=block_n,
                             num_warps=4, **LAUNCH_OPTIONS)
    return out
