"""CPU kernels: rms_norm, rotary, KV write and paged attention (SDPA for prefill; int8/fp8 KV).

fp32 decode-sized calls go to the native kernels of native_ops.py where they build; everything
else runs torch: aten's fused rms_norm, SDPA, batched matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashllm.backends.cpu import lora, native_ops
from flashllm.ops import op_specs
from flashllm.ops._kv_checks import check_kv_scales, dequantize_kv, static_scale_view
from flashllm.ops.rotary_embedding import rotary_embedding as _reference_rotary
from flashllm.ops.write_kv_cache import write_kv_cache as _reference_write_kv_cache
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# fp8 caches only store e4m3 bytes on a CPU: attention dequantizes them to fp32 first, so they
# halve (int8: quarter) KV memory against fp16 (fp32) without needing fp8 arithmetic.
KV_DTYPES = FLOATS | {torch.int8, torch.float8_e4m3fn}

# Ops whose portable PyTorch body already is the torch-native CPU implementation (one fused
# aten call or a memory copy): the cpu backend runs them as they are, by declaration
# (fused_moe has its own kernel: backends/cpu/moe.py).
PORTABLE_OPS = ("gelu_and_mul",)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm: native for fp32 decode rows, else aten's fused kernel; fp32 math, result in x.dtype."""
    fast = native_ops.rms_norm(x, weight, eps, residual)
    if fast is not None:
        return fast
    if residual is not None:
        x = x + residual
    out = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return out if residual is None else (out, x)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm through aten's fused kernel on fp32 rows (weight and bias applied in fp32), result in x.dtype."""
    if residual is not None:
        x = x + residual
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    out = out.to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up through the native kernel for fp32, else the portable body."""
    fast = native_ops.silu_and_mul(x)
    return fast if fast is not None else op_specs()["silu_and_mul"].reference(x)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in place through the native kernel for fp32 q/k, else the portable body (the op's contract)."""
    fast = native_ops.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    return fast if fast is not None else _reference_rotary(positions, q, k, cos_sin_cache, is_neox)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """One index_copy_ per cache for float caches without padding slots; else the portable body."""
    if k_scale is None and v_scale is None and native_ops.write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
        return
    _reference_write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks once, then one scaled_dot_product_attention call.

    Shapes and scale semantics as the op spec: q (T, Hq, D), caches (num_blocks, block_size, Hk, D).
    Quantized caches are dequantized to fp32 as they are gathered, and attention runs in fp32. Capped scores
    (logit_softcap, Gemma 2) and attention sinks (gpt-oss) have no fused form here: such calls run the op's
    reference body.
    """
    if logit_softcap is not None or sinks is not None:
        return op_specs()["paged_attention"].reference(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, alibi_slopes, sliding_window, k_scale,
            v_scale, logit_softcap, sinks)
    mode = check_kv_scales("cpu paged_attention", k_cache, k_scale, v_scale)
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    keys, values = _KVGather(k_cache, k_scale, mode), _KVGather(v_cache, v_scale, mode)
    if mode != "none":
        q = q.float()
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    plain = mode == "none" and alibi_slopes is None and sliding_window is None
    if decode and plain and native_ops.decode_attention(
        q, k_cache, v_cache, block_tables, [starts[b] for b in decode], decode, lens, scale, out
    ):
        done = set(decode)
    elif len(decode) > 1 and alibi_slopes is None and sliding_window is None:
        rows = torch.tensor([starts[b] for b in decode], device=q.device)
        lengths = torch.tensor([lens[b] for b in decode], device=q.device)
        out[rows] = _decode_batch(q[rows], keys, values, block_tables[decode], lengths, scale).to(out.dtype)
        done = set(decode)
    else:
        done = set()
    for b, seq_len in enumerate(lens):
        if b in done:
            continue
        q_start, q_end = starts[b], starts[b + 1]
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].long()
        k = keys(blocks).flatten(0, 1)[:seq_len]  # (S, Hk, D)
        v = values(blocks).flatten(0, 1)[:seq_len]
        if alibi_slopes is None and sliding_window is None:
            if q_end - q_start == 1:
                out[q_start] = _decode_gqa(q[q_start], k, v, scale).to(out.dtype)
                continue
            if q.dtype == torch.float32 and k.dtype == torch.float32:
                out[q_start:q_end] = _prefill_gqa(q[q_start:q_end], k, v, scale)
                continue
        mask = _mask(q_end - q_start, seq_len, alibi_slopes, sliding_window, q.dtype, q.device)
        o = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1),  # (Hq, L, D)
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None and q_end - q_start == seq_len and seq_len > 1,
            scale=scale,
            enable_gqa=True,
        )
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


class _KVGather:
    """Blocks of one cache by block id, dequantized to fp32 when the cache is int8 / fp8.

    Dequantizing right after the gather touches only the blocks a batch reads, once per call.
    """

    def __init__(self, cache: torch.Tensor, scale: torch.Tensor | None, mode: str) -> None:
        self.cache, self.scale, self.mode = cache, scale, mode
        self.block_size, self.num_kv_heads, self.head_dim = cache.shape[1:]

    def __call__(self, tables: torch.Tensor) -> torch.Tensor:
        """tables (...) int64 block ids -> (..., block_size, Hk, D)."""
        blocks = self.cache[tables]
        if self.mode == "none":
            return blocks
        if self.mode == "dynamic":
            return dequantize_kv(blocks, self.scale[tables].unsqueeze(-1))
        return dequantize_kv(blocks, static_scale_view(self.scale))


def _decode_batch(
    q: torch.Tensor, keys: _KVGather, values: _KVGather, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Decode rows of many sequences at once: one gather, two batched matmuls and one softmax.

    q (B, Hq, D); block_tables (B, max_blocks); keys past each sequence's length are masked.
    A per-sequence loop would issue a handful of tiny ops per sequence per layer.
    """
    block_size, num_kv_heads, head_dim = keys.block_size, keys.num_kv_heads, keys.head_dim
    num_blocks = -(-int(seq_lens.max()) // block_size)
    tables = block_tables[:, :num_blocks].long()
    k = keys(tables).flatten(1, 2).permute(0, 2, 3, 1)  # (B, Hk, D, S)
    v = values(tables).flatten(1, 2).transpose(1, 2)  # (B, Hk, S, D)
    batch = q.shape[0]
    scores = torch.matmul(q.view(batch, num_kv_heads, -1, head_dim), k).float() * scale  # (B, Hk, G, S)
    positions = torch.arange(scores.shape[-1], device=q.device)
    scores.masked_fill_((positions[None, :] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, -1, head_dim)  # (B, Hq, D)


def _decode_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token: (Hq, D) against (S, Hk, D); the Hq/Hk query heads of a KV head share one bmm.

    SDPA with enable_gqa takes its slow math path on CPU; two bmm calls read the keys once.
    """
    num_kv_heads = k.shape[1]
    q = q.view(num_kv_heads, -1, q.shape[-1])  # (Hk, G, D)
    scores = torch.bmm(q, k.permute(1, 2, 0)).float() * scale  # (Hk, G, S)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v.transpose(0, 1)).flatten(0, 1)  # (Hq, D)


# A prefill's queries go through _prefill_gqa in chunks whose fp32 scores (Hk x rows x G x S) stay
# near _SCORE_BYTES, and at most _MAX_QUERY_ROWS tokens a chunk (each chunk reads only the keys its
# last query sees, so short chunks skip most of the causal triangle's masked half).
_SCORE_BYTES = 8 << 20
_MAX_QUERY_ROWS = 64


def _prefill_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal fp32 attention of L query tokens, the last L of S positions: q (L, Hq, D), k / v (S, Hk, D).

    SDPA with enable_gqa takes its math path on CPU. Here the G = Hq / Hk query heads of a KV head
    share one bmm against its keys, a chunk of query tokens at a time. On the 0.5b shape's heads
    (14 over 2, 64 wide) this runs 1.1-1.8x SDPA at 32-256 tokens and 2.8x at 1024, and the offline
    workload's prefill attention takes 0.39 s a run against 0.63 s (`intel-2c`, docs/benchmarks.md).
    """
    length, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[:2]
    if length == 0:  # a padding slot of a bucketed batch
        return torch.empty_like(q)
    group, offset = num_heads // num_kv_heads, seq_len - length
    qg = q.reshape(length, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, length * group, head_dim)
    keys, values = k.permute(1, 2, 0), v.transpose(0, 1)  # (Hk, D, S), (Hk, S, D)
    out = torch.empty(num_kv_heads, length * group, head_dim, dtype=q.dtype)
    rows = max(1, min(_MAX_QUERY_ROWS, _SCORE_BYTES // (num_kv_heads * group * seq_len * 4)))
    key_positions = torch.arange(seq_len)[None, :]
    query_positions = torch.arange(offset, seq_len).repeat_interleave(group)[:, None]  # one per qg row
    for first in range(0, length, rows):
        last = min(first + rows, length)
        seen = offset + last  # the keys the chunk's last query sees
        chunk = slice(first * group, last * group)
        scores = torch.bmm(qg[:, chunk], keys[:, :, :seen]).mul_(scale)
        scores.masked_fill_(key_positions[:, :seen] > query_positions[chunk], float("-inf"))
        out[:, chunk] = torch.bmm(torch.softmax(scores, dim=-1), values[:, :seen])
    return out.view(num_kv_heads, length, group, head_dim).transpose(0, 1).reshape(length, num_heads, head_dim)


def _mask(
    q_len: int,
    seq_len: int,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """None when plain causal suffices (full prefill or one decode token); else a float mask."""
    if alibi_slopes is None and sliding_window is None and (q_len == seq_len or q_len == 1):
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (q_pos - k_pos) < sliding_window
    bias = torch.zeros(q_len, seq_len, device=device).masked_fill(~allowed, float("-inf"))
    if alibi_slopes is not None:
        bias = bias + alibi_slopes.float()[:, None, None] * (k_pos - q_pos)  # (Hq, L, S)
    return bias.to(dtype)  # SDPA wants the mask in the query dtype


def register(backend: Backend) -> None:
    """Register the cpu kernels on `backend`."""
    specs = op_specs()
    backend.kernel("rms_norm", Caps(dtypes=FLOATS))(rms_norm)
    backend.kernel("layer_norm", Caps(dtypes=FLOATS))(layer_norm)
    attention_caps = Caps(dtypes=FLOATS, kv_dtypes=KV_DTYPES, alibi=True, softcap=True, sinks=True)
    backend.kernel("paged_attention", attention_caps)(paged_attention)
    backend.kernel("rotary_embedding", Caps(dtypes=FLOATS))(rotary_embedding)
    backend.kernel("silu_and_mul", Caps(dtypes=FLOATS))(silu_and_mul)
    backend.kernel("write_kv_cache", Caps(dtypes=FLOATS, kv_dtypes=KV_DTYPES))(write_kv_cache)
    backend.kernel("lora_shrink", Caps(dtypes=FLOATS))(lora.lora_shrink)
    backend.kernel("lora_expand", Caps(dtypes=FLOATS))(lora.lora_expand)
    for name in PORTABLE_OPS:
        # write_kv_cache's reference body is the CPU implementation, int8/fp8 quantization included
        backend.kernel(name, Caps(dtypes=FLOATS, kv_dtypes=KV_DTYPES))(specs[name].reference)
