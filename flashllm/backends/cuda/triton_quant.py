"""Triton quant_matmul: w8a16 and w4a16 weights dequantized in registers, fp32 accumulation.

Two kernels, picked by the number of rows M:
- `_gemv_kernel` (M <= GEMV_MAX_ROWS, decode): one program per (row, N tile, K split), CUDA-core
  multiply-and-sum; K is split across programs when the N tiles alone cannot fill the GPU, and
  the fp32 partial sums are added by a second pass (deterministic, no atomics).
- `_gemm_kernel` (larger M, prefill): (BLOCK_M, BLOCK_N) output tiles walking K with tl.dot.

Numerics. Where a K tile lies inside one scale group (always for per-channel scales, and for
groups that are a multiple of the tile), the tile's integer codes minus zero point, exact in
fp16/bf16, go into the dot as is and the group's scale multiplies the fp32 partial sum: the same
products the reference's fp32 dequantize-then-matmul makes, only summed in another order. Other
group sizes dequantize each element in fp32, (code - zero) * scale, as the reference does.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last, widen_bf16
from flashllm.ops.quant_matmul import INT4_SYMMETRIC_ZERO, QuantizedWeight

SCHEMES = ("none", "w8a16", "w4a16")
GEMV_MAX_ROWS = 4  # more rows re-read each weight tile once per row: tiled tl.dot wins from here
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16
MAX_BLOCK_K = 128


@triton.jit
def _codes(w_ptr, stride_wn, n, k, mask, IS_INT4: tl.constexpr):
    """Integer codes of W at rows n, columns k (broadcast shapes) as int32; 0 where masked."""
    n = n.to(tl.int64)  # N x K passes 2**31 bytes on large vocab projections
    if IS_INT4:
        byte = tl.load(w_ptr + n * stride_wn + k // 2, mask=mask, other=0).to(tl.int32)
        return (byte >> ((k % 2) * 4)) & 0xF  # low nibble holds the even column
    return tl.load(w_ptr + n * stride_wn + k, mask=mask, other=0).to(tl.int32)


@triton.jit
def _group_params(s_ptr, z_ptr, stride_sn, stride_zn, n, g, mask, HAS_ZEROS: tl.constexpr, ZERO: tl.constexpr):
    """(scale fp32, zero point int32) of group(s) g of rows n (broadcast shapes)."""
    scale = tl.load(s_ptr + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + n * stride_zn + g, mask=mask, other=0).to(tl.int32)
    else:
        zero = tl.zeros_like(g) + ZERO
    return scale, zero


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    N, K, k_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_os,
    IS_INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    PER_ELEMENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)
        mask = n_mask[:, None] & k_mask[None, :]
        codes = _codes(w_ptr, stride_wn, n[:, None], k[None, :], mask, IS_INT4)  # (BLOCK_N, BLOCK_K)
        if PER_ELEMENT:
            scale, zero = _group_params(s_ptr, z_ptr, stride_sn, stride_zn, n[:, None], k[None, :] // group_size,
                                        mask, HAS_ZEROS, ZERO)
            acc += tl.sum((codes - zero).to(tl.float32) * scale * x[None, :], axis=1)
        else:
            g = tl.zeros([BLOCK_N], dtype=tl.int32) + k0 // group_size
            scale, zero = _group_params(s_ptr, z_ptr, stride_sn, stride_zn, n, g, n_mask, HAS_ZEROS, ZERO)
            acc += tl.sum((codes - zero[:, None]).to(tl.float32) * x[None, :], axis=1) * scale
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + split * stride_os + row * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


MAGIC_BITS = tl.constexpr(0x4B000000)  # the bits of the float 2**23
MAGIC_BIAS = tl.constexpr(8388608)  # 2**23


@triton.jit
def _stream_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    N, K, k_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, stride_os,
    IS_INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The decode GEMV for tiles inside one scale group: rows of W streamed with wide loads.

    Products pile up in a (BLOCK_N, tile) fp32 accumulator, one multiply-add per weight, and are
    summed across K once at the end (no cross-thread reduction per tile). An int4 tile is read as
    bytes: the low nibble multiplies the even column of x, the high nibble the odd one. A grouped
    weight scales each tile's products by its group's scale (BLOCK_K divides the group); a
    per-channel one scales the row sum once.
    """
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + row * stride_xm
    WIDTH: tl.constexpr = BLOCK_K // 2 if IS_INT4 else BLOCK_K
    cols = tl.arange(0, WIDTH)
    acc = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    zero = tl.zeros([BLOCK_N], dtype=tl.int32) + ZERO
    scale = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        g = k0 // group_size
        if HAS_ZEROS:
            zero = tl.load(z_ptr + n * stride_zn + g, mask=n_mask, other=0).to(tl.int32)
        if GROUPED:
            scale = tl.load(s_ptr + n * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        # code -> float without int-to-float conversions (a slow unit): a code c in 0..255 OR-ed
        # into the mantissa of 2**23 reads as 2**23 + c, and subtracting 2**23 + zero leaves
        # c - zero exactly
        offset = (zero + (MAGIC_BIAS if IS_INT4 else MAGIC_BIAS + 128)).to(tl.float32)[:, None]
        if IS_INT4:
            byte_cols = k0 // 2 + cols  # the tile's bytes: low nibble = even column, high = odd (K is even)
            byte = tl.load(w_rows + byte_cols[None, :], mask=n_mask[:, None] & (2 * byte_cols < k_end)[None, :],
                           other=0).to(tl.int32)
            low = ((byte & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True) - offset
            high = (((byte >> 4) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True) - offset
            x_even, x_odd = tl.split(tl.reshape(x, [WIDTH, 2]))
            part = low * x_even[None, :] + high * x_odd[None, :]
        else:
            codes = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0).to(tl.int32)
            part = (((codes + 128) | MAGIC_BITS).to(tl.float32, bitcast=True) - offset) * x[None, :]
        if GROUPED:
            acc += part * scale[:, None]
        else:
            acc += part
    total = tl.sum(acc, axis=1)
    if not GROUPED:
        total *= tl.load(s_ptr + n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        total += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + split * stride_os + row * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _split_sum_kernel(partial_ptr, b_ptr, out_ptr, N, total, splits, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum over splits of partial[s, m, n] (in split order) + bias[n], rounded once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(splits):
        acc += tl.load(partial_ptr + split * total + i, mask=mask, other=0.0)
    n = i % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    IS_INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    PER_ELEMENT: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        mask = k_mask[:, None] & n_mask[None, :]
        codes = _codes(w_ptr, stride_wn, n[None, :], k[:, None], mask, IS_INT4)  # (BLOCK_K, BLOCK_N)
        if PER_ELEMENT:
            scale, zero = _group_params(s_ptr, z_ptr, stride_sn, stride_zn, n[None, :], k[:, None] // group_size,
                                        mask, HAS_ZEROS, ZERO)
            w = (codes - zero).to(tl.float32) * scale
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            g = tl.zeros([BLOCK_N], dtype=tl.int32) + k0 // group_size
            scale, zero = _group_params(s_ptr, z_ptr, stride_sn, stride_zn, n, g, n_mask, HAS_ZEROS, ZERO)
            # code - zero is a small integer, exact in every activation dtype: full-rate tensor cores
            if WIDEN:  # the interpreter also converts int -> bf16 wrongly: go through fp32 there
                x = x.to(tl.float32)
                w = (codes - zero[None, :]).to(tl.float32)
            else:
                w = (codes - zero[None, :]).to(x.dtype)
            acc += tl.dot(x, w, input_precision="ieee") * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_k(group_size: int, k: int) -> tuple[int, bool]:
    """(K tile, whether scales must be read per element): tiles stay inside one scale group if they can."""
    whole_k = min(pow2(k, MIN_DOT), MAX_BLOCK_K)
    if group_size == -1:
        return whole_k, False
    aligned = group_size & -group_size  # the largest power of two dividing the group
    if aligned < MIN_DOT:
        return min(whole_k, 64), True
    return min(aligned, MAX_BLOCK_K), False


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: more programs only cost time
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gemv_split_k(rows: int, n_tiles: int, k_tiles: int, device: torch.device) -> int:
    """K splits so that rows x N tiles x splits fills the GPU about four programs deep."""
    want = 4 * _num_sms(device)
    return max(1, min(k_tiles, want // max(rows * n_tiles, 1)))


def _weight_args(weight: QuantizedWeight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(scales, zeros or a dummy, the kernel's weight-format constants)."""
    scales = weight.scales
    zeros = weight.zeros if weight.zeros is not None else scales
    consts = {
        "IS_INT4": weight.scheme == "w4a16",
        "HAS_ZEROS": weight.zeros is not None,
        "ZERO": INT4_SYMMETRIC_ZERO if weight.scheme == "w4a16" else 0,
    }
    return scales, zeros, consts


# (BLOCK_N, BLOCK_K cap, num_warps) of the streaming GEMV per scheme, the fastest of the graph-timed
# sweep on an H100 (benchmarks/gpu/gemv_sweep.py; docs/benchmarks.md); FLASHLLM_GEMV_TILE="16,256,4"
# overrides them for sweeps. Grouped int4 tiles are cut to the group (128) whatever the cap.
STREAM_TILES = {"w8a16": (16, 512, 8), "w4a16": (32, 256, 8)}


def _stream_tile(scheme: str) -> tuple[int, int, int]:
    override = os.environ.get("FLASHLLM_GEMV_TILE")
    if not override:
        return STREAM_TILES[scheme]
    block_n, block_k, warps = (int(v) for v in override.split(","))
    return block_n, block_k, warps


def _gemv(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor,
          split_k: int | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.out_features
    block_k, per_element = _block_k(weight.group_size, k)
    stream = not per_element and (weight.scheme != "w4a16" or k % 2 == 0)
    if stream:
        block_n, cap, num_warps = _stream_tile(weight.scheme)
        # a grouped tile must stay inside its group (block_k divides it); per-channel tiles may be wide
        block_k = min(block_k, cap) if weight.group_size != -1 else min(pow2(k, MIN_DOT), cap)
    else:
        block_n, num_warps = min(pow2(n, 16), 64), 4
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split_k = min(split_k or _gemv_split_k(m, n_tiles, k_tiles, x.device), k_tiles)
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty split
    partial = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    scales, zeros, consts = _weight_args(weight, x.device)
    group = k if weight.group_size == -1 else weight.group_size
    args = (x, weight.data, scales, zeros, bias if bias is not None else scales, partial,
            n, k, k_per_split, group,
            x.stride(0), weight.data.stride(0), scales.stride(0), zeros.stride(0), partial.stride(-2),
            partial.stride(0) if split_k > 1 else 0)
    has_bias = bias is not None and split_k == 1
    if stream:
        _stream_kernel[(n_tiles, split_k, m)](
            *args, HAS_BIAS=has_bias, GROUPED=weight.group_size != -1, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, **consts, **LAUNCH_OPTIONS,
        )
    else:
        _gemv_kernel[(n_tiles, split_k, m)](
            *args, HAS_BIAS=has_bias, PER_ELEMENT=per_element, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, **consts, **LAUNCH_OPTIONS,
        )
    if split_k > 1:
        # the second pass: fp32 partials summed in a fixed order (deterministic, unlike atomics)
        total, block = m * n, 1024
        _split_sum_kernel[(triton.cdiv(total, block),)](
            partial, bias if bias is not None else partial, out, n, total, split_k, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **LAUNCH_OPTIONS,
        )
    return out


def _gemm_tiles(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K cap, num_warps, num_stages) for M rows: small M wastes less of a 16-row tile.

    FLASHLLM_GEMM_TILE="BLOCK_N,BLOCK_K,warps,stages" overrides all but BLOCK_M (tile sweeps).
    """
    block_m = min(pow2(m, MIN_DOT), 128)
    override = os.environ.get("FLASHLLM_GEMM_TILE")
    if override:
        block_n, block_k, warps, stages = (int(v) for v in override.split(","))
        return block_m, block_n, block_k, warps, stages
    return (block_m, 128, 64, 8, 3) if block_m >= 64 else (block_m, 64, 64, 4, 3)


def _gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = weight.out_features
    block_k, per_element = _block_k(weight.group_size, k)
    block_m, block_n, block_k_cap, num_warps, num_stages = _gemm_tiles(m)
    scales, zeros, consts = _weight_args(weight, x.device)
    group = k if weight.group_size == -1 else weight.group_size
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm_kernel[grid](
        x, weight.data, scales, zeros, bias if bias is not None else scales, out,
        m, n, k, group,
        x.stride(0), weight.data.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PER_ELEMENT=per_element, WIDEN=widen_bf16(_gemm_kernel, x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, block_k_cap), num_warps=num_warps,
        num_stages=num_stages,
        **consts, **LAUNCH_OPTIONS,
    )
    return out


def matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
           path: str | None = None, split_k: int | None = None) -> torch.Tensor:
    """quant_matmul with its kernel choice exposed: path "gemv" or "gemm" (default: by rows), split_k for gemv.

    Shapes as `quant_matmul`; tests use `path` and `split_k` to reach every launch on small inputs.
    """
    if weight.scheme not in SCHEMES:
        raise NotImplementedError(
            f"quant_matmul (cuda): scheme {weight.scheme!r} has no Triton kernel; this kernel runs {SCHEMES} "
            "(resolve_ops should have bound the reference for it)"
        )
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    if weight.input_perm is not None:  # act-order checkpoints: the columns are stored permuted
        x = x.index_select(-1, weight.input_perm)
    if weight.scheme == "none":
        return F.linear(x, weight.data.to(x.dtype), None if bias is None else bias.to(x.dtype))
    x2 = x.reshape(-1, x.shape[-1])
    unit_stride_last("quant_matmul", x=x2, data=weight.data, scales=weight.scales)
    if weight.zeros is not None:
        unit_stride_last("quant_matmul", zeros=weight.zeros)
    out = torch.empty((x2.shape[0], weight.out_features), dtype=x.dtype, device=x.device)
    if out.numel():
        bias = None if bias is None else bias.contiguous()
        path = path or ("gemv" if x2.shape[0] <= GEMV_MAX_ROWS else "gemm")
        if path == "gemv":
            _gemv(x2, weight, bias, out, split_k)
        elif path == "gemm":
            _gemm(x2, weight, bias, out)
        else:
            raise ValueError(f"quant_matmul: path {path!r} is unknown; use 'gemv', 'gemm' or None")
    return out.view(*x.shape[:-1], weight.out_features)


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x (..., K) in fp16/bf16/fp32 and a none/w8a16/w4a16 weight; (..., N) in x.dtype.

    Numerics as `flashllm.ops.quant_matmul`: fp32 accumulation, one rounding to x.dtype.
    """
    return matmul(x, weight, bias)
