"""Weight-only int8 / int4 quantization of float (N, K) weights, and weight-byte accounting."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flashllm.ops.quant_matmul import (
    INT4_SYMMETRIC_ZERO,
    QuantizedWeight,
    dequantize,
    pack_int4,
    unpack_int4,
)

__all__ = [
    "QuantizedWeight",
    "WeightBytes",
    "dequantize",
    "pack_int4",
    "quantize_weight",
    "unpack_int4",
    "weight_bytes",
]

INT8_MAX = 127          # symmetric int8 uses -127..127 so that +-max are both representable
INT4_SYMMETRIC_MAX = 7  # symmetric int4 codes -7..7 (stored +8); -8 would leave +max unrepresentable
INT4_LEVELS = 15        # asymmetric int4 codes 0..15
# a scale is never below this, so an all-zero group divides cleanly (its codes are all zero)
_MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_weight(weight: Tensor, scheme: str, group_size: int = -1, symmetric: bool = True) -> QuantizedWeight:
    """Quantize a float (N, K) weight with round-to-nearest: each element's error is <= scale / 2.

    scheme "w8a16": symmetric int8, scale = max|w| / 127 per output channel (group_size -1) or
    per group of `group_size` input features. scheme "w4a16": int4 codes packed two per byte;
    symmetric: scale = max|w| / 7, codes -7..7 stored as 0..15 around zero point 8;
    asymmetric: the group's range [min(w, 0), max(w, 0)] over 15 steps with an integer zero
    point. Scales are fp32 (N, num_groups). Math runs in fp32 on the weight's device.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight expects a float (N, K) weight, got {weight.dtype} {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_weight: the weight has non-finite values (inf/nan); the checkpoint is corrupt")
    n, k = weight.shape
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
        codes, scales = _symmetric(w, INT8_MAX)
        return QuantizedWeight("w8a16", codes.to(torch.int8).reshape(n, k), scales, None, group_size)
    if scheme == "w4a16":
        if symmetric:
            codes, scales = _symmetric(w, INT4_SYMMETRIC_MAX)
            codes, zeros = codes + INT4_SYMMETRIC_ZERO, None
        else:
            codes, scales, zeros = _asymmetric(w, INT4_LEVELS)
        return QuantizedWeight("w4a16", pack_int4(codes.reshape(n, k)), scales, zeros, group_size)
    raise ValueError(f"quantize_weight: unknown scheme {scheme!r}; expected 'w8a16' or 'w4a16'")


def _symmetric(w: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """(codes (N, G, K/G) fp32 in -qmax..qmax, scales (N, G) fp32)."""
    scales = (w.abs().amax(dim=-1) / qmax).clamp(min=_MIN_SCALE)
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
    scales = ((high - low) / levels).clamp(min=_MIN_SCALE)
    zeros = torch.round(-low / scales).clamp(0, levels)
    codes = (torch.round(w / scales[:, :, None]) + zeros[:, :, None]).clamp(0, levels)
    return codes, scales, zeros.to(torch.uint8)


def _divisor_hint(k: int) -> str:
    options = [g for g in (128, 64, 32) if k % g == 0]
    return ", ".join(map(str, options)) if options else "-1"


def max_abs_error(weight: Tensor, quantized: QuantizedWeight) -> Tensor:
    """Per-element |w - dequantize(q)| (N, K) fp32: the quantization error of each weight."""
    return (weight.to(torch.float32) - dequantize(quantized)).abs()


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Bytes a loaded model keeps for its weights.

    linear: the linear layers' weights as stored (quantized data + scales + zeros, or float);
    other: everything else (embeddings, norms, biases, an untied lm_head); total = both.
    Tensors shared between modules (tied embeddings, a dense QuantizedWeight over its
    parameter) are counted once.
    """

    linear: int
    other: int

    @property
    def total(self) -> int:
        return self.linear + self.other


def weight_bytes(model: nn.Module) -> WeightBytes:
    """Count the weight bytes of a loaded model (after process_weights_after_loading)."""
    from flashllm.models.layers.linear import LinearBase

    seen: set[tuple[int, int]] = set()

    def count(tensors: list[Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            key = (t.untyped_storage().data_ptr(), t.numel() * t.element_size())
            if key not in seen:
                seen.add(key)
                total += key[1]
        return total

    linear = 0
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(module, LinearBase) and qweight is not None:
            linear += count([qweight.data, qweight.scales, qweight.zeros])
    other = count([p for _, p in model.named_parameters()])
    return WeightBytes(linear, other)
