"""IPEX kernels for flashllm's ops; intel_extension_for_pytorch is imported at the first call only."""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch
from torch import Tensor

from flashllm.backends.cpu import kernels as cpu_kernels
from flashllm.ops._kv_checks import check_kv_scales
from flashllm.ops.paged_attention import refuse_unclaimed
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
_APPROXIMATIONS = ("none", "tanh")


@cache
def _ipex() -> ModuleType:
    """intel_extension_for_pytorch, imported once (a few seconds) the first time a kernel runs."""
    return importlib.import_module("intel_extension_for_pytorch")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """ipex.llm.functional.rms_norm, or add_rms_norm fused with the residual add.

    x (T, H), weight (H,), residual (T, H) or None. With a residual, IPEX writes x + residual
    into `residual` in place (add_back), which the op spec allows; (normed, residual) is returned.
    """
    functional = _ipex().llm.functional
    x, weight = x.contiguous(), weight.to(x.dtype)
    if residual is None:
        return functional.rms_norm(x, weight, eps)
    residual = residual.contiguous()
    normed = functional.add_rms_norm(residual, x, weight, None, eps, True)
    return normed, residual


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """RoPE through torch_ipex.rotary_position_embedding, the op under ipex.llm.functional.rotary_embedding.

    The public wrapper only takes rot_dim == head_size; the op itself rotates the first rot_dim
    features (partial rotary). It wants rows of [sin | cos], where flashllm's cache holds
    [cos | sin]: the rows of this batch's positions are gathered and swapped (T x rot_dim fp32).
    q (T, Hq, D), k (T, Hk, D); returns new tensors in q.dtype / k.dtype.
    """
    _ipex()
    rot_dim = cos_sin_cache.shape[-1]
    head_size = q.shape[-1]
    if rot_dim % 2 != 0 or rot_dim > head_size or k.shape[-1] != head_size:
        raise ValueError(
            f"ipex rotary_embedding: rot_dim={rot_dim}, q head size {head_size}, k head size {k.shape[-1]}; "
            "expected an even rot_dim <= the common head size"
        )
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    sin_cos = torch.cat((sin, cos), dim=-1).contiguous()  # (T, rot_dim)
    token_ids = torch.arange(q.shape[0], device=q.device).unsqueeze(0)  # row t of sin_cos is token t's
    offset = rot_dim // 2 if is_neox else 1  # distance between the two features of a rotated pair
    rope = torch.ops.torch_ipex.rotary_position_embedding
    q_out, _, _ = rope(q.contiguous().unsqueeze(0), sin_cos, token_ids, q.shape[1], head_size, offset, rot_dim)
    k_out, _, _ = rope(k.contiguous().unsqueeze(0), sin_cos, token_ids, k.shape[1], head_size, offset, rot_dim)
    return q_out.squeeze(0), k_out.squeeze(0)


def _gate_up(x: Tensor, op: str) -> tuple[Tensor, Tensor]:
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"ipex {op}: last dimension {x.shape[-1]} is odd; expected 2 * intermediate_size "
            "(gate columns followed by up columns)"
        )
    gate, up = x.chunk(2, dim=-1)
    return gate.contiguous(), up.contiguous()


def silu_and_mul(x: Tensor) -> Tensor:
    """ipex.llm.functional.silu_mul over the gate and up halves of x (T, 2I); returns (T, I)."""
    gate, up = _gate_up(x, "silu_and_mul")
    return _ipex().llm.functional.silu_mul(gate, up)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """ipex.llm.functional.gelu_mul over the gate and up halves of x (T, 2I); returns (T, I)."""
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"ipex gelu_and_mul: approximate={approximate!r} is not supported; use one of {_APPROXIMATIONS}")
    gate, up = _gate_up(x, "gelu_and_mul")
    return _ipex().llm.functional.gelu_mul(gate, up, None, approximate)


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
    """ipex.llm.modules.PagedAttention over the blocks this batch reads, in IPEX's cache layout.

    IPEX reads caches as contiguous (num_blocks, Hk, block_size, D) and ignores strides (a
    flashllm cache, (num_blocks, block_size, Hk, D), makes it read out of bounds), so each call
    copies the blocks the batch reads into that layout once, as the cpu kernel's gather does.
    All-decode batches run single_query_cached_kv_attention; others flash_attn_varlen_func,
    which has no ALiBi: a batch with a prefill row and ALiBi (or a window of one token) runs the
    cpu backend's kernel.
    Float caches only (IPEX's CPU paged attention stores fp8 as e5m2 with one scale).
    """
    refuse_unclaimed("ipex", logit_softcap, sinks)
    if check_kv_scales("ipex paged_attention", k_cache, k_scale, v_scale) != "none":
        raise ValueError(
            f"ipex paged_attention: a {k_cache.dtype} KV cache is not supported (IPEX's CPU kernel has no "
            "int8/e4m3 cache with per-token scales); resolve_ops picks the cpu kernel for it"
        )
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    is_decode = bool((q_lens == 1).all())
    # flash_attn_varlen_func has no ALiBi and reads window_size_left=0 (a window of 1) as no window
    if not is_decode and (alibi_slopes is not None or sliding_window == 1):
        return cpu_kernels.paged_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, alibi_slopes, sliding_window
        )
    dtype, block_size = q.dtype, k_cache.shape[1]
    keys, tables = _blocks_heads_first(k_cache, block_tables, seq_lens, dtype)
    values, _ = _blocks_heads_first(v_cache, block_tables, seq_lens, dtype)
    q, out = q.contiguous(), torch.empty_like(q)
    paged = _ipex().llm.modules.PagedAttention
    max_seq_len = int(seq_lens.max())
    if is_decode:
        head_mapping = torch.arange(q.shape[1], dtype=torch.int32, device=q.device) // (q.shape[1] // k_cache.shape[2])
        window = -1 if sliding_window is None else sliding_window  # keys with p - key_pos < window
        paged.single_query_cached_kv_attention(
            out, q, keys, values, head_mapping, scale, tables, seq_lens, block_size, max_seq_len, alibi_slopes, window
        )
        return out
    cu_seqlens_k = torch.zeros_like(cu_seqlens_q)
    cu_seqlens_k[1:] = torch.cumsum(seq_lens, 0)
    # window_size_left counts visible keys left of the query's own position: window - 1
    left, right = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    paged.flash_attn_varlen_func(
        out, q, keys, values, cu_seqlens_q, cu_seqlens_k, int(q_lens.max()), max_seq_len, scale, True, tables,
        None, left, right,
    )
    return out


def _blocks_heads_first(cache: Tensor, block_tables: Tensor, seq_lens: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The blocks each sequence reads, as (n, Hk, block_size, D) in `dtype`, and tables (B, max_blocks) into them.

    Sequence b's ceil(seq_len / block_size) blocks are copied in order to rows
    offset_b .. offset_b + n_b - 1; its new table row lists those rows (entries past n_b are 0).
    """
    block_size = cache.shape[1]
    num_blocks = (seq_lens.long() + block_size - 1) // block_size  # (B,)
    width = max(int(num_blocks.max()), 1)
    used = torch.arange(width, device=cache.device)[None, :] < num_blocks[:, None]  # (B, width)
    ids = block_tables[:, :width][used].long()
    tables = torch.zeros(used.shape, dtype=torch.int32, device=cache.device)
    tables[used] = torch.arange(ids.numel(), dtype=torch.int32, device=cache.device)
    return cache[ids].transpose(1, 2).to(dtype).contiguous(), tables


def register(backend: Backend) -> None:
    """Register the IPEX kernels on `backend` (they import IPEX when first called, not here)."""
    backend.kernel("rms_norm", Caps(dtypes=FLOATS))(rms_norm)
    backend.kernel("rotary_embedding", Caps(dtypes=FLOATS))(rotary_embedding)
    backend.kernel("silu_and_mul", Caps(dtypes=FLOATS))(silu_and_mul)
    backend.kernel("gelu_and_mul", Caps(dtypes=FLOATS))(gelu_and_mul)
    backend.kernel("paged_attention", Caps(dtypes=FLOATS, kv_dtypes=FLOATS, alibi=True))(paged_attention)
