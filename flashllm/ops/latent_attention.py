"""latent_attention: multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache."""

from __future__ import annotations

import torch
from torch import Tensor

# not gated on kv_dtype: every op is resolved for every model, and a quantized-KV Llama must not fail on MLA;
# the latent cache is float only, which the MLA model checks when its cache is allocated
USES: frozenset[str] = frozenset({"block_size"})


def check_inputs(q: Tensor, latent: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, slot_mapping: Tensor,
           q_lens: list[int], seq_lens: list[int]) -> tuple[int, int]:
    """Raise ValueError on inconsistent shapes or lengths, or a quantized cache; returns (kv_lora_rank L,
    qk_nope_head_dim Dn). q_lens / seq_lens: the host copies of the query and context lengths."""
    num_heads, rank = kv_b_weight.shape[0], kv_b_weight.shape[2]
    width = kv_cache.shape[-1]
    rope = width - rank
    nope = q.shape[-1] - rope
    if (kv_cache.dim() != 3 or rope <= 0 or nope <= 0 or nope >= kv_b_weight.shape[1] or q.shape[1] != num_heads
            or latent.shape != (q.shape[0], width) or slot_mapping.shape != (q.shape[0],)):
        raise ValueError(
            f"latent_attention: q {tuple(q.shape)}, latent {tuple(latent.shape)}, kv_cache {tuple(kv_cache.shape)}, "
            f"kv_b_weight {tuple(kv_b_weight.shape)}, slot_mapping {tuple(slot_mapping.shape)} do not fit; expected "
            "q (T, H, Dn + R), latent (T, L + R), kv_cache (num_blocks, block_size, L + R), "
            "kv_b_weight (H, Dn + Dv, L), slot_mapping (T,)"
        )
    if not kv_cache.is_floating_point() or kv_cache.itemsize == 1:
        raise ValueError(f"latent_attention: the latent cache is {kv_cache.dtype}; only float caches are supported")
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"latent_attention: sequence {b} has {q_len} query tokens but a context of {seq_len}; "
                             "seq_lens must include the new tokens (expected q_len <= seq_len)")
    return rank, nope


def write_latent(latent: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Copy token t's latent row into slot slot_mapping[t] of kv_cache (num_blocks, block_size, W); -1 skips it."""
    num_blocks, block_size = kv_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"latent_attention: slot {int(slots.max())} is out of range for a cache of {num_blocks} "
                         f"blocks of {block_size}; expected slots in [0, {num_blocks * block_size}) or -1")
    kv_cache[slots // block_size, slots % block_size] = latent[valid].to(kv_cache.dtype)


def gather_latent(kv_cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """The first seq_len latent rows (seq_len, W) of one sequence, in fp32."""
    block_size = kv_cache.shape[1]
    blocks = kv_cache[block_table[: -(-seq_len // block_size)].long()]
    return blocks.flatten(0, 1)[:seq_len].float()


def causal_mask(q_len: int, seq_len: int, device: torch.device) -> Tensor:
    """(q_len, seq_len) bool, True where the query (at positions seq_len - q_len ..) may see the key."""
    k_pos = torch.arange(seq_len, device=device)
    return k_pos[None, :] <= k_pos[seq_len - q_len:, None]


def attend_naive(q: Tensor, context: Tensor, w_kv: Tensor, rank: int, nope: int, scale: float) -> Tensor:
    """One sequence, keys and values up-projected per head: q (n, H, Dn + R), context (S, L + R),
    w_kv (H, Dn + Dv, L), all fp32 -> (n, H, Dv) fp32."""
    latent, k_pe = context[:, :rank], context[:, rank:]
    k_nope = torch.einsum("sl,hdl->shd", latent, w_kv[:, :nope])  # (S, H, Dn)
    values = torch.einsum("sl,hdl->shd", latent, w_kv[:, nope:])  # (S, H, Dv)
    scores = (torch.einsum("qhd,shd->hqs", q[..., :nope], k_nope)
              + torch.einsum("qhr,sr->hqs", q[..., nope:], k_pe)) * scale
    scores = scores.masked_fill(~causal_mask(q.shape[0], context.shape[0], q.device), float("-inf"))
    return torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), values)


def attend_absorbed(q: Tensor, context: Tensor, w_kv: Tensor, rank: int, nope: int, scale: float) -> Tensor:
    """attend_naive with W_UK absorbed into the query and W_UV applied after the weighted sum of latents:
    scores = (q_nope W_UK) . c + q_pe . k_pe, out = (p . c) W_UV^T; the same function, other order."""
    latent, k_pe = context[:, :rank], context[:, rank:]
    q_latent = torch.einsum("qhd,hdl->qhl", q[..., :nope], w_kv[:, :nope])  # (n, H, L)
    scores = (torch.einsum("qhl,sl->hqs", q_latent, latent)
              + torch.einsum("qhr,sr->hqs", q[..., nope:], k_pe)) * scale
    scores = scores.masked_fill(~causal_mask(q.shape[0], context.shape[0], q.device), float("-inf"))
    out_latent = torch.einsum("hqs,sl->qhl", torch.softmax(scores, dim=-1), latent)  # (n, H, L)
    return torch.einsum("qhl,hdl->qhd", out_latent, w_kv[:, nope:])


def latent_attention(
    q: Tensor,
    latent: Tensor,
    kv_cache: Tensor,
    kv_b_weight: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    absorbed: bool = True,
) -> Tensor:
    """Store the new tokens' latents, then causal MLA of B sequences' new tokens over their paged latent context.

    Shapes: q (T, H, Dn + R), each head's no-position part then its rotated part (RoPE applied);
    latent (T, L + R): each new token's normalized compressed KV (L = kv_lora_rank) then its rotated
    shared key part (R = qk_rope_head_dim); kv_cache (num_blocks, block_size, L + R), one row per
    token; kv_b_weight (H, Dn + Dv, L), the per-head up-projection: rows :Dn give the keys (W_UK),
    rows Dn: the values (W_UV); slot_mapping (T,) int64 (-1: not written); block_tables,
    cu_seqlens_q, seq_lens as paged_attention's (seq_lens include the new tokens).
    The latents are written first (as write_kv_cache would), then for a query at position p and a
    context token s <= p: score = scale * (q_nope . (c_s W_UK^T) + q_pe . k_pe_s), and the output is
    sum_s softmax(score)_s * (c_s W_UV^T), per head. absorbed=False computes exactly that (keys and
    values up-projected per head); absorbed=True the same function with W_UK folded into the query
    and W_UV applied to the weighted sum of latents (attention in the L-dim latent space: what a
    decode step wants). The two agree to rounding.
    Numerics: fp32 throughout; returns (T, H, Dv) in q.dtype. Rows past cu_seqlens_q[-1] are
    unspecified. Float caches only (a quantized cache raises ValueError).
    """
    starts = cu_seqlens_q.tolist()
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    lens = seq_lens.tolist()
    rank, nope = check_inputs(q, latent, kv_cache, kv_b_weight, slot_mapping, q_lens, lens)
    write_latent(latent, kv_cache, slot_mapping)
    w_kv = kv_b_weight.float()
    attend = attend_absorbed if absorbed else attend_naive
    out = q.new_zeros(q.shape[0], q.shape[1], kv_b_weight.shape[1] - nope)
    for b, (start, q_len, seq_len) in enumerate(zip(starts[:-1], q_lens, lens, strict=True)):
        if q_len == 0:
            continue
        context = gather_latent(kv_cache, block_tables[b], seq_len)
        out[start:start + q_len] = attend(q[start:start + q_len].float(), context, w_kv, rank, nope, scale).to(q.dtype)
    return out
