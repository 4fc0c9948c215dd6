"""Triton write_kv_cache: scatter the new tokens' keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last
from flashllm.ops._kv_checks import reject_quantized_kv


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_pos, stride_kc_head,
    stride_vc_block, stride_vc_pos, stride_vc_head,
    num_kv_heads, head_size, num_slots,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # -1 marks padding; an out-of-range slot is dropped rather than written past the cache
    if (slot < 0) | (slot >= num_slots):
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None].to(tl.int64)
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_pos + heads * stride_kc_head + dims
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_pos + heads * stride_vc_head + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Copy token t's k, v (T, Hk, D) into slot slot_mapping[t] of the caches, in place.

    Caches (num_blocks, block_size, Hk, D) in fp32/fp16/bf16; values are cast to the cache dtype.
    slot = block * block_size + offset, or -1 to skip a padding token. Unlike the reference, slots
    past the cache are skipped, not reported: checking them on the host would synchronize the
    device every layer; the kernel never writes outside the cache.
    """
    reject_quantized_kv("write_kv_cache", k_cache, k_scale, v_scale)
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"write_kv_cache: k {tuple(k.shape)} and v {tuple(v.shape)} must be (T, Hk, D) and the caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} (num_blocks, block_size, Hk, D) with the same Hk, D"
        )
    unit_stride_last("write_kv_cache", k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    if k.shape[0] == 0:
        return
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_size, num_blocks * block_size,
        BLOCK_SIZE=block_size, HEADS_PAD=pow2(num_kv_heads), D_PAD=pow2(head_size), num_warps=4, **LAUNCH_OPTIONS,
    )
