"""Triton paged_attention launcher: prefill/append tiles plus FlashDecoding split-K for decode rows.

One call launches up to three kernels whose grids depend only on tensor shapes (no host sync,
so the call can be captured in a CUDA graph): the prefill kernel takes the sequences with
q_len > 1, the decode kernel those with q_len == 1 (each split a slice of the context), and the
merge kernel combines the splits. Programs of sequences that belong to the other path exit at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from flashllm.backends.cuda import triton_attention_kernels as kernels
from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last, widen_bf16
from flashllm.ops._kv_checks import reject_quantized_kv

PARTITION_SIZE = 512  # keys per decode split: long enough to amortize a split, short enough to fill SMs
# Small decode batches shorten the splits (down to one key tile) until the grid holds this many
# programs per multiprocessor: one sequence's 8 splits of 512 keys kept 16 programs busy on a
# 132-SM H100, each walking its blocks one after another (5 us per layer at batch 1).
PROGRAMS_PER_SM = 2
PREFILL_ROWS = 64  # (token, head) rows per prefill tile
PREFILL_STAGES = 3  # Triton's default software-pipelining depth
SPLIT_CHUNK = 16  # partials the merge kernel reads per step


@dataclass(frozen=True, slots=True)
class _Shape:
    """Launch constants derived from the tensors' shapes."""

    head_size: int
    d_pad: int
    block_size: int
    block_n: int
    group: int
    num_warps: int


def _shape(q: torch.Tensor, k_cache: torch.Tensor) -> _Shape:
    head_size, block_size, num_kv_heads = q.shape[-1], k_cache.shape[1], k_cache.shape[2]
    d_pad = pow2(head_size, 16)
    return _Shape(
        head_size=head_size,
        d_pad=d_pad,
        block_size=block_size,
        block_n=64 if d_pad <= 128 else 32,
        group=q.shape[1] // num_kv_heads,
        num_warps=4 if d_pad <= 128 else 8,
    )


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           alibi_slopes: torch.Tensor | None, sliding_window: int | None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"paged_attention: expected q (T, Hq, D) and caches (num_blocks, block_size, Hk, D) with the "
            f"same D; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if alibi_slopes is not None and alibi_slopes.shape != (q.shape[1],):
        raise ValueError(f"paged_attention: alibi_slopes must be ({q.shape[1]},), got {tuple(alibi_slopes.shape)}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"paged_attention: sliding_window must be positive or None, got {sliding_window}")
    unit_stride_last("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)


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
    """Causal varlen attention over the paged cache; shapes and numerics as `flashllm.ops.paged_attention`,
    score caps (logit_softcap) and attention sinks included.

    q (T, Hq, D) may have any token/head strides; returns a new contiguous (T, Hq, D) in q.dtype.
    Rows past cu_seqlens_q[-1] are left uninitialized. Lengths are trusted, not checked on the host
    (that would synchronize): q_len <= seq_len <= block_tables.shape[1] * block_size must hold.
    """
    return attend(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                  alibi_slopes, sliding_window, k_scale, v_scale, logit_softcap=logit_softcap, sinks=sinks)


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    partition_size: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with the decode split length exposed (tests force many splits with it)."""
    reject_quantized_kv("paged_attention", k_cache, k_scale, v_scale)
    _check(q, k_cache, v_cache, block_tables, alibi_slopes, sliding_window)
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"paged_attention: logit_softcap must be positive or None, got {logit_softcap}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"paged_attention: sinks must be ({q.shape[1]},), got {tuple(sinks.shape)}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()
    alibi = alibi_slopes.contiguous() if alibi_slopes is not None else q  # q: a never-read placeholder
    sinks = sinks.contiguous() if sinks is not None else None
    shape = _shape(q, k_cache)
    common = dict(
        window=sliding_window or 0, qk_scale=scale * kernels.LOG2E, alibi_scale=kernels.LOG2E,
        softcap=logit_softcap or 1.0,
        HEAD_SIZE=shape.head_size, D_PAD=shape.d_pad, BLOCK_SIZE=shape.block_size, BLOCK_N=shape.block_n,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, HAS_SINKS=sinks is not None,
        WIDEN=widen_bf16(kernels.prefill_kernel, q.dtype), num_warps=shape.num_warps, **LAUNCH_OPTIONS,
    )
    sinks = sinks if sinks is not None else q  # a never-read placeholder
    strides = (
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
    )
    group_pad = pow2(shape.group)
    rows, warps, stages = _prefill_tile(shape)
    block_q = max(rows // group_pad, 1)
    grid = (q.shape[0] // block_q + num_seqs, k_cache.shape[2])
    kernels.prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, alibi, sinks, out, *strides,
        num_seqs, shape.group, BLOCK_Q=block_q, GROUP_PAD=group_pad, **{**common, "num_warps": warps},
        num_stages=stages,
    )
    _decode(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, (alibi, sinks), out, strides, shape,
            partition_size, common)
    return out


def _prefill_tile(shape: _Shape) -> tuple[int, int, int]:
    """(rows per tile, num_warps, num_stages) of the prefill kernel; FLASHLLM_PREFILL_TILE overrides (sweeps)."""
    override = os.environ.get("FLASHLLM_PREFILL_TILE")
    if override:
        rows, warps, stages = (int(v) for v in override.split(","))
        return rows, warps, stages
    return PREFILL_ROWS, shape.num_warps, PREFILL_STAGES


def _partition(max_keys: int, rows: int, block_n: int, device: torch.device) -> int:
    """Keys per decode split: PARTITION_SIZE, halved while rows x splits leaves SMs idle.

    rows = sequences x KV heads. The grid depends only on shapes (block-table width, batch), so
    a captured decode graph keeps one split count.
    """
    if device.type != "cuda":
        return PARTITION_SIZE  # the interpreter: more programs only cost time
    wanted = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    partition = PARTITION_SIZE
    while partition > block_n and rows * triton.cdiv(max_keys, partition) < wanted:
        partition //= 2
    return max(partition, block_n)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor],
            out: torch.Tensor, strides: tuple[int, ...], shape: _Shape, partition_size: int | None,
            common: dict) -> None:
    """Split-K over the context for every sequence with exactly one query token; biases: (alibi slopes, sinks),
    placeholders where the model has none."""
    alibi, sinks = biases
    num_seqs, num_heads = seq_lens.shape[0], q.shape[1]
    max_keys = block_tables.shape[1] * shape.block_size
    if partition_size is None:
        partition_size = _partition(max_keys, num_seqs * k_cache.shape[2], shape.block_n, q.device)
    partition = triton.cdiv(max(partition_size, shape.block_n), shape.block_n) * shape.block_n
    num_splits = max(triton.cdiv(max_keys, partition), 1)
    if num_splits == 1:
        part_out = part_max = part_sum = out  # unused: the kernel writes out directly
    else:
        part_out = torch.empty((num_seqs, num_heads, num_splits, shape.head_size), dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    kernels.decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, alibi, sinks, out, part_out, part_max, part_sum,
        *strides, shape.group, GROUP_PAD=pow2(shape.group, 16), PARTITION=partition, NUM_SPLITS=num_splits,
        **common,
    )
    if num_splits == 1:
        return
    splits_pad = pow2(num_splits)
    kernels.merge_kernel[(num_seqs, num_heads)](
        cu_seqlens_q, seq_lens, sinks, out, part_out, part_max, part_sum, out.stride(0), out.stride(1),
        common["window"], HEAD_SIZE=shape.head_size, D_PAD=shape.d_pad, PARTITION=partition,
        NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad, SPLIT_CHUNK=min(splits_pad, SPLIT_CHUNK),
        HAS_WINDOW=common["HAS_WINDOW"], HAS_SINKS=common["HAS_SINKS"], num_warps=4, **LAUNCH_OPTIONS,
    )
