"""Triton kernels of paged_attention: varlen causal prefill/append, split-K decode, split merge.

Every kernel reads K/V through the block table one key at a time (key n lives at block
block_table[n // BLOCK_SIZE], offset n % BLOCK_SIZE), so a key tile (BLOCK_N) need not match the
cache's block size. Rows of a query tile are (token, query head) pairs of one KV head: all
Hq / Hk query heads sharing a KV head read each K/V tile once (GQA). Softmax runs online in
base 2 (scores pre-multiplied by log2(e)); all masking is per row, so a row whose keys are all
masked in a tile (sliding window, padding rows) contributes nothing instead of NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, WIDEN: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 inputs stay fp32 (no TF32: the op promises fp32 math)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attend_keys(
    q, m_i, l_i, acc, q_pos, slopes,
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    key_lo, scan_lo, key_hi, window, qk_scale, softcap,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WIDEN: tl.constexpr,
):
    """Fold keys [key_lo, key_hi) into the online softmax state (m_i, l_i, acc) of rows q (M, D_PAD).

    Scanning starts at the tile holding scan_lo (>= key_lo): tiles wholly outside every row's
    window are skipped. q_pos (M,) is each row's absolute position; slopes (M,) its ALiBi slope.
    With HAS_SOFTCAP each score s becomes softcap * tanh(s / softcap) (natural units) before the bias.
    """
    dims = tl.arange(0, D_PAD)
    dim_mask = dims < HEAD_SIZE
    for start in range(scan_lo // BLOCK_N * BLOCK_N, key_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = (keys >= key_lo) & (keys < key_hi)
        block = tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        offset = (keys % BLOCK_SIZE).to(tl.int64)
        k_off = block * stride_kb + offset * stride_kp + kv_head * stride_kh  # (BLOCK_N,)
        v_off = block * stride_vb + offset * stride_vp + kv_head * stride_vh
        k_t = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None],
                      mask=dim_mask[:, None] & key_mask[None, :], other=0.0)  # (D_PAD, BLOCK_N)
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :],
                    mask=key_mask[:, None] & dim_mask[None, :], other=0.0)  # (BLOCK_N, D_PAD)
        scores = _mma(q, k_t.to(q.dtype), WIDEN) * qk_scale  # (M, BLOCK_N), log2 units
        if HAS_SOFTCAP:
            scores = _capped(scores, softcap)
        if HAS_ALIBI:
            scores += slopes[:, None] * (keys[None, :] - q_pos[:, None]).to(tl.float32)
        visible = key_mask[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= (q_pos[:, None] - keys[None, :]) < window
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P is rounded to the activation dtype for the tensor-core dot, as flash attention does
        acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v.to(q.dtype), WIDEN)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _capped(scores, softcap):
    """Scores in log2 units capped as softcap * tanh(score / softcap) in natural units, tanh(y) written as
    1 - 2 / (exp(2y) + 1) (exact at both ends: exp2 overflows to inf, or underflows to 0)."""
    y2 = scores * (2.0 / softcap)  # 2y in log2 units: exp(2y) = exp2(y2)
    return (1.0 - 2.0 / (tl.exp2(y2) + 1.0)) * (softcap * LOG2E)


@triton.jit
def _with_sink(m_i, l_i, acc, sink):
    """Add a sink logit sink (M,) (log2 units) to online softmax states: it joins the denominator and adds no
    value. Returns (l_i, acc) rescaled to the new running max."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _find_seq(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile q_block: sequence b owns tiles from
    cu_seqlens_q[b] // BLOCK_Q + b on, which leaves each at least cdiv(q_len, BLOCK_Q) tiles."""
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= q_block, mid, lo)
        hi = tl.where(first_tile <= q_block, hi, mid)
    return lo


@triton.jit
def prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, alibi_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_table, stride_ot, stride_oh,
    num_seqs, group, window, qk_scale, alibi_scale, softcap,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Grid (cu_seqlens_q[-1] // BLOCK_Q + B, Hk): one tile of BLOCK_Q tokens x GROUP_PAD heads.

    Sequences with q_len <= 1 are left to the decode kernel.
    """
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile = q_block - (q_start // BLOCK_Q + seq)
    if (q_len <= 1) | (tile * BLOCK_Q >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys before the first new token: the cached prefix
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * group + rows % GROUP_PAD
    row_mask = (token < q_len) & (rows % GROUP_PAD < group)
    q_pos = context + token
    dims = tl.arange(0, D_PAD)
    io_mask = row_mask[:, None] & (dims[None, :] < HEAD_SIZE)
    q_row = (q_start + token).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + dims[None, :], mask=io_mask, other=0.0)
    slopes = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * alibi_scale
    key_hi = tl.minimum(seq_len, context + (tile + 1) * BLOCK_Q)  # causal: the tile's last token
    scan_lo = 0
    if HAS_WINDOW:
        scan_lo = tl.maximum(context + tile * BLOCK_Q - window + 1, 0)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, q_pos, slopes,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
        stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
        0, scan_lo, key_hi, window, qk_scale, softcap,
        HEAD_SIZE, D_PAD, BLOCK_SIZE, BLOCK_N, HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, WIDEN,
    )
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * LOG2E
        l_i, acc = _with_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_row = (q_start + token).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_row[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, alibi_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_table, stride_ot, stride_oh,
    group, window, qk_scale, alibi_scale, softcap,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_PAD: tl.constexpr, PARTITION: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Grid (B, Hk, NUM_SPLITS): the one query of a decode sequence, all heads of a KV head,
    against keys [split * PARTITION, (split + 1) * PARTITION).

    With NUM_SPLITS == 1 the result goes straight to out; otherwise the normalized partial output,
    its running max (log2 units) and sum go to part_* (B, Hq, NUM_SPLITS[, HEAD_SIZE]) fp32, and the merge adds
    the sinks.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    key_lo = split * PARTITION
    key_hi = tl.minimum(key_lo + PARTITION, seq_len)
    scan_lo = key_lo
    if HAS_WINDOW:
        scan_lo = tl.maximum(key_lo, seq_len - window)
    if scan_lo >= key_hi:
        return  # past the context, or wholly before the window: the merge skips this split
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * group + rows
    row_mask = rows < group
    dims = tl.arange(0, D_PAD)
    io_mask = row_mask[:, None] & (dims[None, :] < HEAD_SIZE)
    q_row = q_start.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + dims[None, :], mask=io_mask, other=0.0)
    slopes = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * alibi_scale
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, q_pos, slopes,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
        stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
        key_lo, scan_lo, key_hi, window, qk_scale, softcap,
        HEAD_SIZE, D_PAD, BLOCK_SIZE, BLOCK_N, HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, WIDEN,
    )
    if HAS_SINKS and NUM_SPLITS == 1:
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * LOG2E
        l_i, acc = _with_sink(m_i, l_i, acc, sink)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_row = q_start.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_row[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (seq.to(tl.int64) * (group * tl.num_programs(1)) + head) * NUM_SPLITS + split  # (GROUP_PAD,)
        tl.store(part_out_ptr + part[:, None] * HEAD_SIZE + dims[None, :], out, mask=io_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)


@triton.jit
def merge_kernel(
    cu_seqlens_q_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    stride_ot, stride_oh, window,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid (B, Hq): combine a decode row's split partials, weighting each by exp(max) * sum; a head's sink
    joins the denominator."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    window_lo = 0
    if HAS_WINDOW:
        window_lo = tl.maximum(seq_len - window, 0)
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    # the split kernel wrote split s iff its key range met [window_lo, seq_len)
    valid = (splits < NUM_SPLITS) & (splits * PARTITION < seq_len) & ((splits + 1) * PARTITION > window_lo)
    m_all = tl.load(part_max_ptr + base + splits, mask=valid, other=float("-inf"))
    m_max = tl.max(m_all, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    total = tl.sum(tl.where(valid, tl.exp2(m_all - m_max) * tl.load(part_sum_ptr + base + splits, mask=valid,
                                                                      other=0.0), 0.0), axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)
    dims = tl.arange(0, D_PAD)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for first in range(0, NUM_SPLITS, SPLIT_CHUNK):
        chunk = first + tl.arange(0, SPLIT_CHUNK)
        ok = (chunk < NUM_SPLITS) & (chunk * PARTITION < seq_len) & ((chunk + 1) * PARTITION > window_lo)
        m = tl.load(part_max_ptr + base + chunk, mask=ok, other=float("-inf"))
        weight = tl.where(ok, tl.exp2(m - m_max) * tl.load(part_sum_ptr + base + chunk, mask=ok, other=0.0), 0.0)
        o = tl.load(part_out_ptr + (base + chunk)[:, None] * HEAD_SIZE + dims[None, :],
                    mask=ok[:, None] & (dims[None, :] < HEAD_SIZE), other=0.0)
        acc += tl.sum(o * weight[:, None], axis=0)
    o_row = q_start.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_row + dims, (acc / total).to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)
