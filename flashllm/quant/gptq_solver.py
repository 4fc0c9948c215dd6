"""GPTQ: column-by-column rounding with inverse-Hessian error feedback, plus the RTN baseline on the same grid."""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import integer_codes
from flashllm.quant.gptq import IntegerWeight
from flashllm.quant.weight_only import quantize_weight

DEFAULT_BLOCK_COLUMNS = 128  # columns rounded before the lazy update of the rest (the paper's B)
DEFAULT_DAMP = 0.01          # dampening: this share of the Hessian's mean diagonal is added to it
_MIN_SCALE = torch.finfo(torch.float32).tiny


def qmax_symmetric(bits: int) -> int:
    """Largest symmetric code magnitude: 7 for int4, 127 for int8 (so +-max are both representable)."""
    return 2 ** (bits - 1) - 1


def group_params(w: Tensor, bits: int, sym: bool) -> tuple[Tensor, Tensor]:
    """Scale and integer zero point per row of w (N, M) fp32 -> (scales (N,) fp32, zeros (N,) int32).

    The grid of flashllm.quant.quantize_weight: symmetric: scale = max|w| / (2**(bits-1) - 1),
    zero 2**(bits-1); asymmetric: [min(w, 0), max(w, 0)] over 2**bits - 1 steps.
    """
    if sym:
        scales = (w.abs().amax(dim=1) / qmax_symmetric(bits)).clamp(min=_MIN_SCALE)
        return scales, torch.full_like(scales, 2 ** (bits - 1), dtype=torch.int32)
    levels = 2**bits - 1
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scales = ((high - low) / levels).clamp(min=_MIN_SCALE)
    zeros = torch.round(-low / scales).clamp(0, levels)
    return scales, zeros.to(torch.int32)


def round_to_grid(w: Tensor, scales: Tensor, zeros: Tensor, bits: int, sym: bool) -> Tensor:
    """Codes of w (N,) or (N, M) on per-row grids (N,) -> int32 codes of w's shape."""
    if w.dim() == 2:
        scales, zeros = scales[:, None], zeros[:, None]
    low, high = (1, 2**bits - 1) if sym else (0, 2**bits - 1)
    return (torch.round(w / scales) + zeros).clamp(low, high).to(torch.int32)


def rtn_quantize(weight: Tensor, bits: int, group_size: int, sym: bool = True) -> IntegerWeight:
    """Round-to-nearest through flashllm.quant.quantize_weight (the weight_only_int8/int4 schemes).

    weight: float (N, K). bits 8 is symmetric only (w8a16); bits 4 either. Returns an IntegerWeight
    with contiguous groups (g_idx = k // group_size, all zero for group_size -1).
    """
    scheme = {8: "w8a16", 4: "w4a16"}.get(bits)
    if scheme is None:
        raise ValueError(f"RTN supports 4 or 8 bits, got {bits}")
    quantized = quantize_weight(weight, scheme, group_size, sym)
    codes, zeros = integer_codes(quantized)
    if bits == 8:  # int8 codes -127..127 become unsigned codes around zero point 128
        codes, zeros = codes + 128, zeros + 128
    k = weight.shape[1]
    return IntegerWeight(codes, zeros, quantized.scales.to(torch.float32),
                         contiguous_g_idx(k, group_size, weight.device), bits)


def contiguous_g_idx(k: int, group_size: int, device: torch.device | str = "cpu") -> Tensor:
    """int64 (K,) group of each input feature when groups are runs of group_size (-1: one group)."""
    size = k if group_size == -1 else group_size
    return torch.arange(k, dtype=torch.int64, device=device) // size


def inverse_hessian_factor(hessian: Tensor, damp: float = DEFAULT_DAMP) -> Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, fp32 (K, K).

    Row i of U, from the diagonal on, is how the not-yet-rounded columns i.. absorb column i's
    rounding error (the paper's Cholesky reformulation of the OBS update).
    """
    k = hessian.shape[0]
    h = hessian.to(torch.float32).clone()
    h.diagonal().add_(damp * h.diagonal().mean().clamp(min=_MIN_SCALE))
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    chol = torch.linalg.cholesky(h)
    inverse = torch.cholesky_solve(eye, chol)
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(weight: Tensor, hessian: Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                  desc_act: bool = False, damp: float = DEFAULT_DAMP,
                  block_columns: int = DEFAULT_BLOCK_COLUMNS) -> IntegerWeight:
    """GPTQ (Frantar et al. 2022) of a float (N, K) weight given its input Hessian H = 2 X^T X / n (K, K).

    Columns are rounded one at a time; each column's error, divided by the inverse Hessian's
    pivot, is spread over the columns not yet rounded. Updates inside a block of
    `block_columns` are applied at once, the rest lazily after the block. A group's scale and
    zero are fixed, from the already-updated weights, when its first column comes up.
    desc_act rounds columns in order of decreasing H[k, k] (act-order); groups are then runs of
    `group_size` columns in that order and g_idx maps each input feature to its group.
    Features that never saw a non-zero input (H[k, k] == 0) are rounded to code zero.
    """
    n, k = weight.shape
    if group_size != -1 and (group_size <= 0 or k % group_size):
        raise ValueError(f"group_size {group_size} must be -1 or divide in_features {k}")
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(torch.float32, copy=True)
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(h.diagonal(), descending=True) if desc_act else torch.arange(k, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    u = inverse_hessian_factor(h, damp)
    size = k if group_size == -1 else group_size
    codes = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    scales = torch.zeros(n, k // size, dtype=torch.float32, device=w.device)
    zeros = torch.zeros(n, k // size, dtype=torch.int32, device=w.device)
    for start in range(0, k, block_columns):
        end = min(start + block_columns, k)
        errors = _round_block(w, u, start, end, size, bits, sym, codes, scales, zeros)
        w[:, end:] -= errors @ u[start:end, end:]
    inverse_perm = torch.argsort(perm)
    g_idx = (torch.arange(k, device=w.device) // size)[inverse_perm]
    return IntegerWeight(codes[:, inverse_perm], zeros, scales, g_idx, bits)


def _round_block(w: Tensor, u: Tensor, start: int, end: int, size: int, bits: int, sym: bool,
                 codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """Round columns start..end of w in place order; returns the scaled errors (N, end - start).

    Inside the block every update is applied at once so the next column sees it; the caller
    applies the block's errors to the columns after it.
    """
    block = w[:, start:end]  # a view: updates land in w, so a group starting here sees them
    errors = torch.zeros_like(block)
    for i in range(end - start):
        col = start + i
        if col % size == 0:
            scale, zero = group_params(w[:, col:col + size], bits, sym)
            scales[:, col // size], zeros[:, col // size] = scale, zero
        g = col // size
        q = round_to_grid(block[:, i], scales[:, g], zeros[:, g], bits, sym)
        codes[:, col] = q
        dequantized = (q - zeros[:, g]).to(torch.float32) * scales[:, g]
        err = (block[:, i] - dequantized) / u[col, col]
        block[:, i:] -= err[:, None] * u[col, start + i:end][None, :]
        errors[:, i] = err
    return errors


def reconstruction_error(weight: Tensor, quantized: IntegerWeight, hessian: Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the summed squared output error ||W X - Q X||^2 times 2 / n."""
    delta = weight.to(torch.float32) - quantized.dequantize()
    return float(torch.einsum("nk,kl,nl->", delta, hessian.to(torch.float32), delta))
