"""CPU latent_attention (MLA): one index_copy_ for the latents, then native absorbed decode or SDPA per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.backends.cpu import native, native_ops, parallel
from flashllm.ops.latent_attention import causal_mask, check_inputs
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})


def _write(latent: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Latent rows into their slots: one index_copy_ over the flattened cache (padding slots -1 skipped)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat.index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))
    else:
        flat.index_copy_(0, slot_mapping[valid], latent[valid].to(kv_cache.dtype))


def _naive(q: Tensor, context: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    """q (n, H, Dn + R), context (S, L + R), w_uk (H, Dn, L), w_uv (H, Dv, L), fp32 -> (n, H, Dv):
    keys and values up-projected per head, then one SDPA call."""
    rank = w_uk.shape[2]
    latent, k_pe = context[:, :rank], context[:, rank:]
    heads = q.shape[1]
    k_nope = torch.matmul(latent, w_uk.transpose(1, 2))  # (H, S, Dn)
    values = torch.matmul(latent, w_uv.transpose(1, 2))  # (H, S, Dv)
    keys = torch.cat((k_nope, k_pe.expand(heads, -1, -1)), dim=-1)  # (H, S, Dn + R)
    return _sdpa(q.transpose(0, 1), keys, values, scale).transpose(0, 1)


def _absorbed(q: Tensor, context: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    """The same attention in the latent space: one key of L + R features and one value of L per token,
    shared by every head (MQA), with W_UK folded into the query and W_UV applied to the output. The
    shared keys make the scores one (H * n, L + R) x (L + R, S) product (SDPA would expand them per head)."""
    rank, nope = w_uk.shape[2], w_uk.shape[1]
    n, heads = q.shape[0], q.shape[1]
    q = q.transpose(0, 1)  # (H, n, Dn + R)
    q_latent = torch.matmul(q[..., :nope], w_uk)  # (H, n, L)
    query = torch.cat((q_latent, q[..., nope:]), dim=-1).reshape(heads * n, -1)  # (H * n, L + R)
    scores = torch.matmul(query, context.T).view(heads, n, -1) * scale  # (H, n, S)
    if n > 1:
        scores = scores.masked_fill(~causal_mask(n, context.shape[0], q.device), float("-inf"))
    out_latent = torch.matmul(torch.softmax(scores, dim=-1).view(heads * n, -1), context[:, :rank])
    return torch.matmul(out_latent.view(heads, n, rank), w_uv.transpose(1, 2)).transpose(0, 1)  # (n, H, Dv)


def _sdpa(query: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """Causal attention of (H, n, D) queries, the last n of S positions, over (H, S, D) keys and (H, S, Dv) values."""
    n, s = query.shape[1], keys.shape[1]
    mask = None if n in (1, s) else causal_mask(n, s, query.device)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=n == s and n > 1,
                                          scale=scale)


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
    """The op's contract (flashllm.ops.latent_attention), fp32 math, through SDPA; shapes as the op spec."""
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    nope = check_inputs(q, latent, kv_cache, kv_b_weight, slot_mapping, q_lens, lens)[1]
    _write(latent, kv_cache, slot_mapping)
    if absorbed and max(q_lens, default=0) == 1 == min(q_lens):
        out = _native_decode(q, kv_cache, kv_b_weight, block_tables, lens, nope, scale)
        if out is not None:
            return out
    w_kv = kv_b_weight.float()
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    attend = _absorbed if absorbed else _naive
    block_size = kv_cache.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], w_uv.shape[1])
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        blocks = block_tables[b, : -(-seq_len // block_size)].long()
        context = kv_cache[blocks].flatten(0, 1)[:seq_len].float()
        out[start:end] = attend(q[start:end].float(), context, w_uk, w_uv, scale).to(out.dtype)
    return out


def _native_decode(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor, seq_lens: list[int],
                   nope: int, scale: float) -> Tensor | None:
    """A decode batch (one query token per sequence, row b of q for sequence b) in the absorbed form on the
    native kernels: q_nope W_UK per head (csrc/mla_decode.c), one-token attention of the H heads over the
    latent rows as one shared key/value head of L + R (csrc/decode_attention.c; the R rope columns of
    its output are not used), then W_UV per head. fp32 only; None (nothing computed) where not taken.
    Why: torch's batched one-row products of W_UK / W_UV read ~9.5 GB/s here (docs/deepseek.md)."""
    heads, rows, rank = kv_b_weight.shape
    width = kv_cache.shape[-1]
    if not (native_ops._ready(q, kv_cache, kv_b_weight) and kv_b_weight.is_contiguous() and kv_cache.is_contiguous()
            and q.stride(2) == 1):
        return None
    tokens, dv, lib, threads = len(seq_lens), rows - nope, native.library(), parallel.workers()
    query = torch.empty(tokens, heads, width)
    lib.flashllm_mla_vxm_mt(q.data_ptr(), q.stride(0), q.stride(1), kv_b_weight.data_ptr(), rows * rank,
                            query.data_ptr(), heads * width, width, tokens, heads, nope, rank, threads)
    query[:, :, rank:] = q[:, :, nope:]
    out_latent = torch.empty(tokens, heads, width)
    cache = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], 1, width)
    batch = list(range(tokens))
    if not native_ops.decode_attention(query, cache, cache, block_tables.to(torch.int32), batch, batch, seq_lens,
                                       scale, out_latent):
        return None
    out = torch.empty(q.shape[0], heads, dv) if q.shape[0] == tokens else q.new_zeros(q.shape[0], heads, dv)
    w_uv = kv_b_weight.data_ptr() + nope * rank * kv_b_weight.element_size()
    lib.flashllm_mla_mxv_mt(out_latent.data_ptr(), heads * width, width, w_uv, rows * rank, out.data_ptr(),
                            heads * dv, dv, tokens, heads, rank, dv, threads)
    return out


def register(backend: Backend) -> None:
    """Register the cpu latent_attention kernel on `backend`."""
    backend.kernel("latent_attention", Caps(dtypes=FLOATS))(latent_attention)
