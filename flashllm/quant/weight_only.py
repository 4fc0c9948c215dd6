"""Quantization of float (N, K) weights: int8, int4, per-channel A8W8 / FP8 weights."""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import (
    FP8_E4M3_MAX,
    INT4_SYMMETRIC_ZERO,
    INT8_MAX,
    MIN_SCALE,
    QuantizedWeight,
    dequantize,
    pack_int4,
    unpack_int4,
)

__all__ = [
    "QuantizedWeight",
    "dequantize",
    "pack_int4",
    "quantize_weight",
    "unpack_int4",
]

INT4_SYMMETRIC_MAX = 7  # symmetric int4 codes -7..7 (stored +8); -8 would leave +max unrepresentable
INT4_LEVELS = 15        # asymmetric int4 codes 0..15


def quantize_weight(
    weight: Tensor, scheme: str, group_size: int = -1, symmetric: bool = True, smooth: Tensor | None = None
) -> QuantizedWeight:
    """Quantize a float (N, K) weight with round-to-nearest: each element's error is <= scale / 2.

    scheme "w8a16": symmetric int8, scale = max|w| / 127 per output channel (group_size -1) or
    per group of `group_size` input features. scheme "w4a16": int4 codes packed two per byte;
    symmetric: scale = max|w| / 7, codes -7..7 stored as 0..15 around zero point 8;
    asymmetric: the group's range [min(w, 0), max(w, 0)] over 15 steps with an integer zero
    point. scheme "a8w8": the w8a16 codes per output channel. scheme "fp8": per output
    channel scale = max|w| / 448, codes = e4m3(w / scale) (error <= half an e4m3 step, i.e.
    2**-4 relative for normal codes). "a8w8"/"fp8" take group_size -1 only, and `smooth` (K,):
    SmoothQuant factors the weight was already multiplied by, kept for the op to divide x by.
    Scales are fp32 (N, num_groups). Math runs in fp32 on the weight's device.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight expects a float (N, K) weight, got {weight.dtype} {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_weight: the weight has non-finite values (inf/nan); the checkpoint is corrupt")
    n, k = weight.shape
    if scheme in ("a8w8", "fp8"):
        return _per_channel_activation_scheme(weight, scheme, group_size, symmetric, smooth)
    if smooth is not None:
        raise ValueError(f"smooth factors apply to a8w8/fp8, not {scheme!r}; divide the weight's columns by them")
    if group_size != -1 and (group_size <= 0 or k % group_size):
        raise ValueError(
            f"group_size {group_size} does not divide in_features {k}; use -1 (per output channel) or a "
            f"divisor of {k} such as {_divisor_hint(k)}"
        )
    groups = 1 if group_size == -1 else k // group_size
    w = weight.detach().to(torch.float32).reshape(n, groups, k // groups)  # (N, G, K/G)
    if scheme == "w8a16":
        if not symmetric:
            raise ValueError("w8a16 is symmetric only; drop the asymmetric option or use w4a16")
        codes, scales = symmetric_codes(w, INT8_MAX)
        return QuantizedWeight("w8a16", codes.to(torch.int8).reshape(n, k), scales, None, group_size)
    if scheme == "w4a16":
        if symmetric:
            codes, scales = symmetric_codes(w, INT4_SYMMETRIC_MAX)
            codes, zeros = codes + INT4_SYMMETRIC_ZERO, None
        else:
            codes, scales, zeros = _asymmetric(w, INT4_LEVELS)
        return QuantizedWeight("w4a16", pack_int4(codes.reshape(n, k)), scales, zeros, group_size)
    raise ValueError(f"quantize_weight: unknown scheme {scheme!r}; expected 'w8a16', 'w4a16', 'a8w8' or 'fp8'")


def _per_channel_activation_scheme(
    weight: Tensor, scheme: str, group_size: int, symmetric: bool, smooth: Tensor | None
) -> QuantizedWeight:
    """a8w8 (int8 codes) or fp8 (e4m3 codes), one fp32 scale per output channel."""
    if group_size != -1 or not symmetric:
        raise ValueError(f"{scheme} weights are symmetric with one scale per output channel; got "
                         f"group_size {group_size}, symmetric={symmetric}: use group_size -1")
    w = weight.detach().to(torch.float32)[:, None, :]  # (N, 1, K)
    smooth = None if smooth is None else smooth.to(device=weight.device, dtype=torch.float32)
    if scheme == "a8w8":
        codes, scales = symmetric_codes(w, INT8_MAX)
        return QuantizedWeight("a8w8", codes.to(torch.int8)[:, 0], scales, smooth=smooth)
    scales = (w.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp(min=MIN_SCALE)
    codes = (w / scales[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", codes[:, 0], scales, smooth=smooth)


def symmetric_codes(w: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """w (N, G, K/G) -> (codes (N, G, K/G) fp32 in -qmax..qmax, scales (N, G) fp32): round to nearest
    against scale = max|w| / qmax per group (at least fp32's smallest normal). Also the cpu greedy
    screen's int8 copy of the LM head (backends/cpu/greedy_screen.py), NaN codes where w has them."""
    scales = (w.abs().amax(dim=-1) / qmax).clamp(min=MIN_SCALE)
    codes = torch.round(w / scales[:, :, None]).clamp(-qmax, qmax)
    return codes, scales


def _asymmetric(w: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """(codes (N, G, K/G) in 0..levels, scales (N, G) fp32, zero points (N, G) uint8).

    The range always contains 0 so that the zero point lands inside 0..levels; then
    round(w / s) + zero stays within [-0.5, levels + 0.5] and clamping moves no code by more
    than half a step.
    """
    low = w.amin(dim=-1).clamp(max=0)
    high = w.amax(dim=-1).clamp(min=0)
    scales = ((high - low) / levels).clamp(min=MIN_SCALE)
    zeros = torch.round(-low / scales).clamp(0, levels)
    codes = (torch.round(w / scales[:, :, None]) + zeros[:, :, None]).clamp(0, levels)
    return codes, scales, zeros.to(torch.uint8)


def _divisor_hint(k: int) -> str:
    options = [g for g in (128, 64, 32) if k % g == 0]
    return ", ".join(map(str, options)) if options else "-1"


def max_abs_error(weight: Tensor, quantized: QuantizedWeight) -> Tensor:
    """Per-element |w - dequantize(q)| (N, K) fp32: the quantization error of each weight."""
    return (weight.to(torch.float32) - dequantize(quantized)).abs()
