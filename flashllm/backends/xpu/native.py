"""Torch-native kernels that run on any torch device: fused torch calls instead of the reference loops.

Shared by the adapters whose vendor documents no LLM-specific ops we could cite (xpu, gcu) and by
npu for the ops torch_npu has no public fused call for. Every function here has its op's exact
signature and is checked against the reference on CPU (tests/unit/test_vendor_adapters.py); on the
vendor device it runs through that device's own implementation of the same torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.ops._kv_checks import reject_quantized_kv
from flashllm.ops.paged_attention import refuse_unclaimed
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm through torch's fused F.rms_norm (fp32 statistics), rounded like the reference."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: x has hidden size {x.shape[-1]} but weight has {weight.shape[-1]}; they must match")
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight.to(x.dtype)
    return normed if residual is None else (normed, x)


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """One index_copy_ per cache over the flat (num_blocks * block_size) slot axis; -1 slots skipped."""
    reject_quantized_kv("write_kv_cache", k_cache, k_scale, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"write_kv_cache: slot {int(slots.max())} is out of range for a cache of {num_slots} slots")
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def _gather(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """(Hk, seq_len, D): the first seq_len tokens of one sequence, heads first for SDPA."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len].transpose(0, 1)


def _attn_bias(
    q_len: int, seq_len: int, alibi_slopes: Tensor | None, sliding_window: int | None, device: torch.device
) -> Tensor | None:
    """Additive fp32 bias (Hq or 1, q_len, seq_len), or None when plain causal masking is enough."""
    if alibi_slopes is None and sliding_window is None:
        return None
    k_pos = torch.arange(seq_len, device=device)
    distance = (k_pos[seq_len - q_len :, None] - k_pos[None, :]).float()  # query pos - key pos
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    bias = torch.zeros(distance.shape, device=device).masked_fill(~visible, float("-inf")).unsqueeze(0)
    if alibi_slopes is not None:
        bias = bias - alibi_slopes.float()[:, None, None] * distance
    return bias


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """SDPA of q (Hq, q_len, D) over k, v (Hk, seq_len, D) in fp32; returns (q_len, Hq, D)."""
    q_len, seq_len = q.shape[1], k.shape[1]
    # Queries are the last q_len positions: causal from the top-left corner only when q_len == seq_len.
    causal = bias is None and 1 < q_len == seq_len
    if bias is None and 1 < q_len < seq_len:
        bias = _attn_bias(q_len, seq_len, None, seq_len, q.device)  # a window of seq_len = pure causal
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=bias, is_causal=causal, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out.transpose(0, 1)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    alibi_slopes: Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Per sequence: gather its blocks once, then one scaled_dot_product_attention call (fp32 math)."""
    reject_quantized_kv("paged_attention", k_cache, k_scale, v_scale)
    refuse_unclaimed("xpu", logit_softcap, sinks)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"paged_attention: sliding_window must be positive or None, got {sliding_window}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out = torch.zeros_like(q)
    for b, (start, end, seq_len) in enumerate(zip(starts[:-1], starts[1:], lens, strict=True)):
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"paged_attention: sequence {b} has {q_len} query tokens but a context of {seq_len}")
        k = _gather(k_cache, block_tables[b], seq_len)
        v = _gather(v_cache, block_tables[b], seq_len)
        bias = _attn_bias(q_len, seq_len, alibi_slopes, sliding_window, q.device)
        out[start:end] = _attend(q[start:end].transpose(0, 1), k, v, bias, scale).to(q.dtype)
    return out


# Shape-generic: any head size and block size the cache layout allows.
NATIVE_KERNELS = {
    "rms_norm": (rms_norm, Caps(dtypes=FLOATS)),
    "write_kv_cache": (write_kv_cache, Caps(dtypes=FLOATS, kv_dtypes=FLOATS)),
    "paged_attention": (paged_attention, Caps(dtypes=FLOATS, kv_dtypes=FLOATS, alibi=True)),
}


def register(backend: Backend, ops: tuple[str, ...] = tuple(NATIVE_KERNELS)) -> None:
    """Register the torch-native kernels of `ops` on `backend`."""
    for op in ops:
        fn, caps = NATIVE_KERNELS[op]
        backend.kernel(op, caps)(fn)
