"""paged_attention: causal attention of a varlen batch over the paged KV cache."""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ops._kv_checks import check_kv_scales, dequantize_kv, static_scale_view

USES: frozenset[str] = frozenset({"kv_dtype", "head_size", "block_size", "alibi", "softcap", "sinks"})


def _gather_context(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """The first seq_len tokens of one sequence from cache (num_blocks, block_size, Hk, D)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # (num_blocks, block_size, Hk, D)
    return blocks.flatten(0, 1)[:seq_len]  # (seq_len, Hk, D)


def _context_kv(cache: Tensor, scale: Tensor | None, mode: str, block_table: Tensor, seq_len: int) -> Tensor:
    """One sequence's keys or values (seq_len, Hk, D): as stored, or dequantized to fp32."""
    stored = _gather_context(cache, block_table, seq_len)
    if mode == "none":
        return stored
    if mode == "dynamic":
        return dequantize_kv(stored, _gather_context(scale, block_table, seq_len).unsqueeze(-1))
    return dequantize_kv(stored, static_scale_view(scale))


def _score_bias(q_pos: Tensor, k_pos: Tensor, alibi_slopes: Tensor | None, sliding_window: int | None) -> Tensor:
    """Additive bias (Hq or 1, q_len, seq_len) fp32: -inf where masked, ALiBi where given."""
    distance = q_pos[:, None] - k_pos[None, :]  # (q_len, seq_len), >= 0 for visible keys
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    bias = torch.zeros(distance.shape, dtype=torch.float32, device=q_pos.device)
    bias = bias.masked_fill(~visible, float("-inf")).unsqueeze(0)
    if alibi_slopes is not None:
        bias = bias + alibi_slopes.float()[:, None, None] * (-distance).float()
    return bias


def _attend_one(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, softcap: float | None = None,
                sinks: Tensor | None = None) -> Tensor:
    """Attention of q (q_len, Hq, D) over k, v (seq_len, Hk, D) in fp32, scores capped to softcap * tanh(s / softcap)
    where softcap is given, each head's sink logit (sinks (Hq,)) joining its softmax where given; returns
    (q_len, Hq, D)."""
    q_len, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # query head h reads KV head h // group: view the query heads as (Hk, group)
    qg = q.float().view(q_len, num_kv_heads, group, head_size)
    scores = torch.einsum("qkgd,skd->kgqs", qg, k.float()) * scale  # (Hk, group, q_len, seq_len)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(num_heads, q_len, -1) + bias
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink takes a share of the softmax and contributes no value
        sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("kgqs,skd->qkgd", probs.reshape(num_kv_heads, group, q_len, -1), v.float())
    return out.reshape(q_len, num_heads, head_size)


def refuse_unclaimed(backend: str, logit_softcap: float | None, sinks: Tensor | None = None) -> None:
    """For kernels whose Caps claim neither softcap nor sinks: raise NotImplementedError when a score cap or
    attention sinks are given (the op table binds such a kernel only for models without them, so this guards
    direct calls)."""
    if logit_softcap is not None or sinks is not None:
        what = "cap attention scores" if logit_softcap is not None else "add attention sinks"
        raise NotImplementedError(f"{backend} paged_attention does not {what} and its caps do not claim it; resolve "
                                  "the op table with OpRequest(softcap=True) / OpRequest(sinks=True) to bind a kernel "
                                  "that does (the reference)")


def _check_layout(q: Tensor, k_cache: Tensor, q_lens: list[int], seq_lens: list[int]) -> None:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"paged_attention: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if not 0 <= q_len <= seq_len:
            raise ValueError(
                f"paged_attention: sequence {b} has {q_len} query tokens but a context of "
                f"{seq_len}; seq_lens must include the new tokens (expected q_len <= seq_len)"
            )


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
    """Causal attention of B sequences' new tokens over their paged context.

    Shapes: q (T, Hq, D), the new tokens of all sequences back to back; k_cache, v_cache
    (num_blocks, block_size, Hk, D); block_tables (B, max_blocks) int32, physical block ids of
    each sequence's context in order (entries past the context are ignored); cu_seqlens_q (B+1,)
    int32 prefix sums of query lengths; seq_lens (B,) int32 context lengths INCLUDING the new
    tokens, whose K/V must already be in the cache (write_kv_cache runs first).

    Sequence b's q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b] queries sit at positions
    seq_len - q_len .. seq_len - 1, so one call covers prefill (q_len == seq_len), prefill after
    a cached prefix or chunk (q_len < seq_len) and decode (q_len == 1), mixed freely.
    Query at position p sees keys 0..p; with sliding_window W only keys with p - key_pos < W.
    GQA: query head h reads KV head h // (Hq // Hk). scores = scale * q.k, plus
    alibi_slopes[h] * (key_pos - p) when alibi_slopes (Hq,) fp32 is given (ALiBi; Baichuan-13B's own code adds
    slope * key_pos, which differs by a constant per query row that softmax cancels). A kernel serves models
    with ALiBi only where its Caps say alibi=True. With logit_softcap c (Gemma 2's attn_logit_softcapping) each
    score becomes c * tanh(score / c) before the bias and the softmax; a kernel serves such models only where its
    Caps say softcap=True. With sinks (Hq,) fp32 (gpt-oss) head h's softmax gets one more logit, sinks[h], whose
    probability is dropped (it attends to nothing), so the weights of the real keys sum to less than one; a
    kernel serves such models only where its Caps say sinks=True.
    Numerics: scores, softmax and the weighted sum of V in fp32; returns (T, Hq, D) in q.dtype.
    Rows past cu_seqlens_q[-1] (batch padding) are unspecified.

    Quantized caches (torch.int8, torch.float8_e4m3fn) need float32 k_scale and v_scale: scale
    caches (num_blocks, block_size, Hk) written by write_kv_cache (dynamic), or () / (Hk,)
    calibrated scales (static). K and V are dequantized to code * scale per (slot, head) in fp32
    and the attention math above runs on them in fp32. A float cache given scales, or a
    quantized cache without them, raises ValueError.
    """
    mode = check_kv_scales("paged_attention", k_cache, k_scale, v_scale)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"paged_attention: sliding_window must be positive or None, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"paged_attention: logit_softcap must be positive or None, got {logit_softcap}")
    if sinks is not None and (not sinks.is_floating_point() or tuple(sinks.shape) != (q.shape[1],)):
        raise ValueError(f"paged_attention: sinks must be float of shape ({q.shape[1]},), one per query head; got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    starts = cu_seqlens_q.tolist()
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    lens = seq_lens.tolist()
    _check_layout(q, k_cache, q_lens, lens)
    out = torch.zeros_like(q)
    for b, (start, q_len, seq_len) in enumerate(zip(starts[:-1], q_lens, lens, strict=True)):
        if q_len == 0:
            continue
        k = _context_kv(k_cache, k_scale, mode, block_tables[b], seq_len)
        v = _context_kv(v_cache, v_scale, mode, block_tables[b], seq_len)
        k_pos = torch.arange(seq_len, device=q.device)
        q_pos = k_pos[seq_len - q_len :]
        bias = _score_bias(q_pos, k_pos, alibi_slopes, sliding_window)
        out[start : start + q_len] = _attend_one(q[start : start + q_len], k, v, bias, scale, logit_softcap,
                                                            sinks).to(q.dtype)
    return out
