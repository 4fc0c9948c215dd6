"""Shared argument checks and int8/fp8 (de)quantization of the ops that touch the paged KV cache.

Quantized KV caches store codes (torch.int8 or torch.float8_e4m3fn) beside float32 scales; the
scales' dimensionality says how they were chosen:

* dynamic: k_scale / v_scale are scale CACHES (num_blocks, block_size, Hk), one scale per written
  (slot, KV head), set by write_kv_cache to max|x| over head_dim / qmax (never below SCALE_FLOOR).
* static: k_scale / v_scale are () or (Hk,) calibrated scales, read-only; values beyond
  qmax * scale saturate.

code = round(x / scale) clamped to [-127, 127] for int8 (round half to even), or x / scale
clamped to [-448, 448] and cast to e4m3 (round to nearest) for fp8; x ~= code * scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Largest code magnitude per quantized KV dtype: symmetric int8, and e4m3fn's largest finite value.
KV_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# A dynamic scale never drops to 0, so an all-zero head dequantizes to 0 instead of 0 * inf / NaN.
SCALE_FLOOR = 1e-10


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether `dtype` is a quantized KV cache dtype (int8 or float8_e4m3fn)."""
    return dtype in KV_QMAX


def reject_quantized_kv(op: str, cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """Raise NotImplementedError in a kernel that runs float KV caches only.

    Such kernels do not claim int8/fp8 in their caps, so the resolver never binds them to a
    quantized cache; reaching this means the kernel was called directly.
    """
    if k_scale is not None or v_scale is not None or not cache.dtype.is_floating_point or cache.dtype.itemsize == 1:
        raise NotImplementedError(
            f"{op}: this kernel supports float KV caches only (got a {cache.dtype} cache"
            f"{' with k_scale/v_scale' if k_scale is not None or v_scale is not None else ''}); "
            "quantized int8/fp8 caches run on the reference kernel (and the cpu backend)"
        )


def check_kv_scales(op: str, cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> str:
    """Validate a KV cache against its scales; returns "none" (float), "dynamic" or "static".

    cache (num_blocks, block_size, Hk, D). Raises ValueError for a float cache given scales, a
    quantized cache without both scales, an unsupported 1-byte dtype, or mis-shaped scales.
    """
    given = k_scale is not None or v_scale is not None
    if not is_quantized_kv(cache.dtype):
        if cache.dtype.is_floating_point and cache.dtype.itemsize > 1:
            if given:
                raise ValueError(
                    f"{op}: k_scale/v_scale were given for a {cache.dtype} KV cache; scales belong to "
                    "int8/fp8 caches only: drop them, or allocate the cache as torch.int8 / torch.float8_e4m3fn"
                )
            return "none"
        raise ValueError(f"{op}: KV cache dtype {cache.dtype} is not supported; expected float32, "
                         "float16, bfloat16, int8 or float8_e4m3fn")
    if k_scale is None or v_scale is None:
        raise ValueError(
            f"{op}: a {cache.dtype} KV cache needs both k_scale and v_scale (float32 scale caches "
            "(num_blocks, block_size, Hk) for dynamic, or () / (Hk,) for static scales)"
        )
    num_blocks, block_size, num_kv_heads = cache.shape[:3]
    dynamic_shape = (num_blocks, block_size, num_kv_heads)
    kinds = {_scale_kind(op, name, s, dynamic_shape) for name, s in (("k_scale", k_scale), ("v_scale", v_scale))}
    if len(kinds) != 1:
        raise ValueError(f"{op}: k_scale {tuple(k_scale.shape)} and v_scale {tuple(v_scale.shape)} mix dynamic "
                         "and static scales; give both as scale caches or both as static scales")
    return kinds.pop()


def _scale_kind(op: str, name: str, scale: Tensor, dynamic_shape: tuple[int, int, int]) -> str:
    if scale.dtype != torch.float32:
        raise ValueError(f"{op}: {name} must be float32, got {scale.dtype}")
    if tuple(scale.shape) == dynamic_shape:
        return "dynamic"
    if scale.dim() == 0 or tuple(scale.shape) == (dynamic_shape[2],):
        return "static"
    raise ValueError(
        f"{op}: {name} has shape {tuple(scale.shape)}; expected {dynamic_shape} (dynamic scale cache), "
        f"({dynamic_shape[2]},) or () (static scales)"
    )


def dynamic_scales(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Per-row scales of x (..., D): max|x| over the last dim / qmax, at least SCALE_FLOOR; fp32 (...)."""
    return (x.float().abs().amax(dim=-1) / KV_QMAX[dtype]).clamp_min(SCALE_FLOOR)


def quantize_kv(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Codes of x (..., D) in `dtype` with `scale` broadcast against x (e.g. (..., 1) or (Hk, 1)).

    Division in fp32; int8 rounds half to even and clamps to +-127, fp8 clamps to +-448 (so the
    cast saturates instead of producing NaN) and rounds to the nearest e4m3 value.
    """
    qmax = KV_QMAX[dtype]
    scaled = x.float() / scale
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp(-qmax, qmax).to(dtype)


def static_scale_view(scale: Tensor) -> Tensor:
    """A static scale, () or (Hk,), shaped to broadcast against (..., Hk, D)."""
    return scale.reshape(-1, 1) if scale.dim() == 1 else scale


def dequantize_kv(codes: Tensor, scale: Tensor) -> Tensor:
    """codes (..., D) times `scale` (broadcastable) in fp32."""
    return codes.float() * scale
