"""Triton rms_norm and layer_norm: one program per row, optionally fused with the residual add."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last

MAX_BLOCK = 8192  # wider rows are walked in chunks: a whole 16k-wide fp32 row would spill registers


def _row_buffers(op: str, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x rows, residual rows (x's without a residual), output rows, new-residual rows (the output without a
    residual)), each (T, H); the inputs' last dimension must have unit stride."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    unit_stride_last(op, x=x2, residual=res2)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    return x2, res2, out, torch.empty_like(out) if residual is not None else out


def _block_and_warps(hidden: int) -> tuple[int, int]:
    """(chunk width, num_warps) of a one-row-per-program norm over rows `hidden` wide."""
    block = min(pow2(hidden), MAX_BLOCK)
    return block, min(max(block // 256, 1), 16)


@triton.jit
def _stream_chunk(x_row, res_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """fp32 values of x (+ residual, rounded to x's dtype as the op's residual stream is)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    s = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_row + cols, mask=mask, other=0.0)
        # an fp32 sum of two half-precision values rounded once equals the native half add
        s = (s + r.to(tl.float32)).to(x.dtype).to(tl.float32)
    return s


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    res_out_row = res_out_ptr + row * stride_res_out
    out_row = out_ptr + row * stride_out
    sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        s = _stream_chunk(x_row, res_row, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_out_row + cols, s.to(res_out_ptr.dtype.element_ty), mask=mask)
        sum_sq += s * s
    inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
    # second pass re-reads the inputs (L2-resident) rather than the residual just stored, which
    # another thread of this program may have written
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        s = _stream_chunk(x_row, res_row, cols, mask, HAS_RESIDUAL)
        out_ty = out_ptr.dtype.element_ty
        normed = (s * inv_rms).to(out_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(out_ty).to(tl.float32)
        tl.store(out_row + cols, (normed * w).to(out_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of x (T, H) scaled by weight (H,); numerics as `flashllm.ops.rms_norm`.

    With residual (T, H): returns (normed, x + residual), both new (T, H) tensors in x.dtype.
    Rows may be strided; the hidden dimension must be contiguous. Inputs are not modified.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"rms_norm: x has hidden size {x.shape[-1]} but weight has {weight.shape[-1]}; they must match"
        )
    hidden = x.shape[-1]
    x2, res2, out, res_out = _row_buffers("rms_norm", x, residual)
    weight = weight.contiguous()
    rows = x2.shape[0]
    if rows:
        block, warps = _block_and_warps(hidden)
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps, **LAUNCH_OPTIONS,
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


@triton.jit
def _layer_norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    res_out_row = res_out_ptr + row * stride_res_out
    out_row = out_ptr + row * stride_out
    # each chunk's mean and centred sum of squares, merged into the row's (Chan et al.): one read for
    # the statistics, as rms_norm takes, without E[x^2] - mean^2's cancellation on rows far off zero mean
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        s = _stream_chunk(x_row, res_row, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_out_row + cols, s.to(res_out_ptr.dtype.element_ty), mask=mask)
        n_chunk = tl.sum(mask.to(tl.float32), axis=0)
        mean_chunk = tl.sum(s, axis=0) / n_chunk
        centered = tl.where(mask, s - mean_chunk, 0.0)
        delta = mean_chunk - mean
        total = count + n_chunk
        mean = mean + delta * (n_chunk / total)
        m2 = m2 + tl.sum(centered * centered, axis=0) + delta * delta * (count * n_chunk / total)
        count = total
    inv_std = tl.rsqrt(m2 / hidden + eps)
    # second pass re-reads the inputs, as rms_norm's does (the residual just stored may be another thread's)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        s = _stream_chunk(x_row, res_row, cols, mask, HAS_RESIDUAL)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (s - mean) * inv_std * w
        if HAS_BIAS:
            normed += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of each row of x (T, H): weight (H,), bias (H,) or None; numerics as `flashllm.ops.layer_norm`.

    fp32 statistics, scale and bias, one cast to x.dtype. With residual (T, H): returns
    (normed, x + residual), both new (T, H) tensors in x.dtype. Rows may be strided; the hidden
    dimension must be contiguous. Inputs are not modified.
    """
    hidden = x.shape[-1]
    if weight.shape[-1] != hidden or (bias is not None and bias.shape[-1] != hidden):
        raise ValueError(
            f"layer_norm: x has hidden size {hidden} but weight has {weight.shape[-1]}"
            + ("" if bias is None else f" and bias {bias.shape[-1]}")
            + "; they must match (check the norm layer's hidden_size)"
        )
    x2, res2, out, res_out = _row_buffers("layer_norm", x, residual)
    weight = weight.contiguous()
    bias_arg = bias.contiguous() if bias is not None else weight  # never read without HAS_BIAS
    rows = x2.shape[0]
    if rows:
        block, warps = _block_and_warps(hidden)
        _layer_norm_kernel[(rows,)](
            x2, res2, weight, bias_arg, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps,
            **LAUNCH_OPTIONS,
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
