"""xla latent_attention: MLA as one static-shape graph (dense masked attention over each token's gathered context)."""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.backends.xla.kernels import DTYPES, _padding_safe_slots, _token_positions
from flashllm.registry.backend import Backend, Caps


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
    """The op's contract (flashllm.ops.latent_attention) without reading a tensor value on the host.

    Latents scatter as xla write_kv_cache does (a padding token repeats a real token's write); each
    query token reads its sequence's whole gathered context (T, W * block_size, L + R) with keys past
    its position masked, in the absorbed or the naive form; fp32 math, (T, H, Dv) in q.dtype. Shapes
    are only checked statically (a range check would sync the device).
    """
    if kv_cache.dim() != 3 or not kv_cache.is_floating_point() or kv_cache.itemsize == 1:
        raise ValueError(f"xla latent_attention: kv_cache {kv_cache.dtype} {tuple(kv_cache.shape)}; expected a float "
                         "(num_blocks, block_size, L + R) cache")
    num_tokens = q.shape[0]
    rank = kv_b_weight.shape[2]
    nope = q.shape[-1] - (kv_cache.shape[-1] - rank)
    src, slots, real = _padding_safe_slots(slot_mapping)
    block_size = kv_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    rows = torch.where(real[:, None], latent.index_select(0, src).to(kv_cache.dtype), kv_cache[blocks, offsets])
    kv_cache.index_put_((blocks, offsets), rows)
    seq_idx, q_pos = _token_positions(cu_seqlens_q, seq_lens, num_tokens)
    context = kv_cache[block_tables.long().index_select(0, seq_idx)].flatten(1, 2).float()  # (T, S, L + R)
    visible = torch.arange(context.shape[1], device=q.device)[None, :] <= q_pos[:, None]  # (T, S)
    w = kv_b_weight.float()
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    qf = q.float()
    c, k_pe = context[..., :rank], context[..., rank:]
    rope_scores = torch.einsum("thr,tsr->ths", qf[..., nope:], k_pe)
    if absorbed:
        q_latent = torch.einsum("thd,hdl->thl", qf[..., :nope], w_uk)
        scores = torch.einsum("thl,tsl->ths", q_latent, c) + rope_scores
    else:
        scores = torch.einsum("thd,tshd->ths", qf[..., :nope], torch.einsum("tsl,hdl->tshd", c, w_uk)) + rope_scores
    probs = torch.softmax((scores * scale).masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    if absorbed:
        out = torch.einsum("thl,hdl->thd", torch.einsum("ths,tsl->thl", probs, c), w_uv)
    else:
        out = torch.einsum("ths,tshd->thd", probs, torch.einsum("tsl,hdl->tshd", c, w_uv))
    return out.to(q.dtype)


def register(backend: Backend) -> None:
    """Register the xla latent_attention kernel (fp32 and bf16, float latent caches)."""
    backend.kernel("latent_attention", Caps(DTYPES, kv_dtypes=DTYPES))(latent_attention)
