"""ctypes wrappers of the native per-layer ops (RMSNorm, rotary, one-token paged attention, SiLU-and-mul).

At decode sizes torch spends tens of microseconds per call on these (`epyc3-2c` in
docs/benchmarks.md, one token of the 0.5b shape, torch at one thread: rms_norm with a residual 27 us,
rotary 85 us, write + paged attention of one token ~280 us per layer), against a few microseconds
of arithmetic. Each wrapper says which inputs it takes (fp32, the layouts the engine produces)
and returns None otherwise, so the caller runs its torch body; every index the C code follows
is range-checked here first, so a bad table raises instead of reading outside a buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.backends.cpu import native, parallel

MAX_NORM_ROWS = 64  # past a decode batch torch's threaded kernel is the better choice
# Per-head norms (Qwen3's q_norm / k_norm: rows of head_dim, tokens x heads of them) stay native up to
# this many rows, so a decode token's heads get the same bits alone and in any decode batch, and the
# fused decode step (which norms them natively) computes what this op does
HEAD_NORM_MAX_WIDTH = 512
HEAD_NORM_MAX_ROWS = 1 << 12
# below this many outputs one thread finishes silu_and_mul before a hand-off would pay
SILU_SPLIT_ELEMENTS = 1 << 16
# decode attention: below this many (sequence, head, context slot) triples one thread is done first
# (14 heads of 64 features at batch 1 on `epyc3-2c`, workers spinning: 16 slots 6.3 us on
# one thread against 7.6 on two, 64 slots 14.6 against 11.8, 128 slots 16.5 against 13.8; the line
# sits between 16 and 64 slots)
ATTENTION_SPLIT_WORK = 1 << 9


def _ready(*tensors: Tensor) -> bool:
    return native.library() is not None and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm(x: Tensor, weight: Tensor, eps: float,
             residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor] | None:
    """The rms_norm op for fp32 x (T <= MAX_NORM_ROWS, H; or up to HEAD_NORM_MAX_ROWS rows of at most
    HEAD_NORM_MAX_WIDTH) and weight (H,); None where not taken."""
    extra = () if residual is None else (residual,)
    if x.dim() != 2 or x.shape[0] > (HEAD_NORM_MAX_ROWS if x.shape[1] <= HEAD_NORM_MAX_WIDTH else MAX_NORM_ROWS):
        return None
    if (weight.shape != (x.shape[1],)
            or not _ready(x, weight, *extra) or (residual is not None and residual.shape != x.shape)):
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    res = None if residual is None else residual.contiguous()
    native.library().flashllm_rms_norm(
        x.data_ptr(), None if res is None else res.data_ptr(), None if summed is None else summed.data_ptr(),
        weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out if residual is None else (out, summed)


def _rotatable(x: Tensor) -> bool:
    # heads of D contiguous within a token; tokens may be strided (q and k are views of a fused qkv)
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
                     is_neox: bool) -> tuple[Tensor, Tensor] | None:
    """The rotary_embedding op in place on fp32 q (T, Hq, D), k (T, Hk, D); None where not taken."""
    if not (_ready(q, k, cos_sin_cache) and _rotatable(q) and _rotatable(k) and positions.dtype == torch.int64
            and cos_sin_cache.dim() == 2 and cos_sin_cache.is_contiguous() and q.shape[0] == positions.shape[0]):
        return None
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > q.shape[2] or rot > k.shape[2]:
        return None
    positions = positions.contiguous()
    if positions.numel():
        low, high = torch.aminmax(positions)
        if int(low) < 0 or int(high) >= cos_sin_cache.shape[0]:
            return None  # the reference body raises its own error for an out-of-range position
    lib = native.library()
    for x in (q, k):
        lib.flashllm_rotary(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], rot,
                            cos_sin_cache.data_ptr(), positions.data_ptr(), int(is_neox))
    return q, k


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> bool:
    """Float-cache write of every token's K and V by index_copy_; False (nothing written) where not taken.

    Taken when every slot is in range (no -1 padding) and the caches are contiguous in their dtype.
    """
    if (k_cache.dtype != k.dtype or v_cache.dtype != v.dtype or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or slot_mapping.numel() == 0 or slot_mapping.dtype != torch.int64):
        return False
    low, high = torch.aminmax(slot_mapping)
    if int(low) < 0 or int(high) >= k_cache.shape[0] * k_cache.shape[1]:
        return False
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
    return True


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, rows: list[int],
                     seqs: list[int], seq_lens: list[int], scale: float, out: Tensor) -> bool:
    """One-token attention of sequences `seqs` (query rows `rows` of q) into the same rows of out.

    fp32 q (T, Hq, D) with heads contiguous, fp32 caches (blocks, block_size, Hk, D), out (T, Hq, D)
    contiguous. False (nothing written) where not taken.
    """
    if not (_ready(q, k_cache, v_cache, out) and _rotatable(q) and out.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.dtype == torch.int32):
        return False
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    tables = block_tables[seqs].contiguous()
    lens = [seq_lens[b] for b in seqs]
    if max(lens) > tables.shape[1] * block_size or min(lens) < 1:
        return False
    used = tables[:, : -(-max(lens) // block_size)]
    low, high = torch.aminmax(used)
    if int(low) < 0 or int(high) >= num_blocks or q.shape[1] % num_kv_heads:
        return False
    rows_t = torch.tensor(rows, dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    # (sequence, head) pairs over the cores once the keys read are worth a hand-off
    threads = parallel.workers() if len(seqs) * q.shape[1] * max(lens) >= ATTENTION_SPLIT_WORK else 1
    native.library().flashllm_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens_t.data_ptr(), rows_t.data_ptr(), len(seqs), q.shape[1], num_kv_heads, head_dim, block_size,
        scale, out.data_ptr(), threads)
    return True


def silu_and_mul(x: Tensor) -> Tensor | None:
    """The silu_and_mul op for contiguous fp32 x (T, 2I); None where not taken.

    torch runs it as a SiLU over a strided half of x and a separate multiply: 27 ms + 25 ms per
    layer for a 1881-token prefill of the 0.5b shape on `epyc3-2c` (docs/benchmarks.md). The native body reads
    x once and computes e^-g in AVX2 lanes (~2 ulp), split over the cores for prefill sizes.
    """
    if not (_ready(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 2 == 0 and x.shape[1] > 0):
        return None
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=torch.float32)
    threads = parallel.workers() if tokens * inter >= SILU_SPLIT_ELEMENTS else 1
    native.library().flashllm_silu_and_mul_mt(x.data_ptr(), out.data_ptr(), tokens, inter, threads)
    return out
