"""Triton rotary_embedding: rotates queries and keys in place, neox or interleaved pairing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, num_heads, token, cos, sin, half,
                  IS_NEOX: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """Rotate the first 2 * half features of every head of one token; cos, sin (HALF_PAD,) fp32."""
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        first, second = pairs, pairs + half  # feature i pairs with i + rot_dim / 2
    else:
        first, second = 2 * pairs, 2 * pairs + 1  # adjacent features pair up
    mask = (heads[:, None] < num_heads) & (pairs[None, :] < half)
    base = ptr + token * stride_t + heads[:, None].to(tl.int64) * stride_h
    x1 = tl.load(base + first[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + second[None, :], mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    y1 = x1f * cos[None, :] - x2f * sin[None, :]
    y2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(base + first[None, :], y1.to(x1.dtype), mask=mask)
    tl.store(base + second[None, :], y2.to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_q_heads, num_k_heads, half,
    IS_NEOX: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + pairs, mask=pairs < half, other=1.0).to(tl.float32)
    sin = tl.load(row + half + pairs, mask=pairs < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, num_q_heads, token, cos, sin, half, IS_NEOX, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr, stride_kt, stride_kh, num_k_heads, token, cos, sin, half, IS_NEOX, K_HEADS_PAD, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q (T, Hq, D) and k (T, Hk, D) at positions (T,), IN PLACE; returns (q, k).

    cos_sin_cache (max_position, rot_dim) as [cos | sin]; only the first rot_dim features of each
    head rotate, in fp32. Token and head strides may be anything (views of a fused qkv output);
    the feature dimension must be contiguous. Positions are not bounds-checked (a host check
    would synchronize the device every layer): they must be < max_position.
    """
    rot_dim, head_size = cos_sin_cache.shape[-1], q.shape[-1]
    if rot_dim % 2 != 0 or rot_dim > head_size or k.shape[-1] != head_size:
        raise ValueError(
            f"rotary_embedding: cos_sin_cache has rot_dim={rot_dim}, q head size {head_size}, "
            f"k head size {k.shape[-1]}; expected an even rot_dim <= the common head size"
        )
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or positions.shape[0] != q.shape[0]:
        raise ValueError(
            f"rotary_embedding: expected positions (T,), q (T, Hq, D), k (T, Hk, D); got "
            f"{tuple(positions.shape)}, {tuple(q.shape)}, {tuple(k.shape)}"
        )
    unit_stride_last("rotary_embedding", q=q, k=k, cos_sin_cache=cos_sin_cache)
    if q.shape[0]:
        half = rot_dim // 2
        _rotary_kernel[(q.shape[0],)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            q.shape[1], k.shape[1], half,
            IS_NEOX=bool(is_neox), Q_HEADS_PAD=pow2(q.shape[1]), K_HEADS_PAD=pow2(k.shape[1]),
            HALF_PAD=pow2(half), num_warps=4, **LAUNCH_OPTIONS,
        )
    return q, k
