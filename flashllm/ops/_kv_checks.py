"""Shared argument checks of the ops that touch the paged KV cache."""

from __future__ import annotations

from torch import Tensor


def reject_quantized_kv(op: str, cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """Raise NotImplementedError for a quantized KV cache, which no reference supports yet."""
    if k_scale is not None or v_scale is not None:
        raise NotImplementedError(
            f"{op}: k_scale/v_scale were given, but quantized KV caches are not implemented yet; "
            "run with an unquantized kv cache dtype (e.g. --kv-cache-dtype auto)"
        )
    if not cache.dtype.is_floating_point or cache.dtype.itemsize == 1:
        raise NotImplementedError(
            f"{op}: KV cache dtype {cache.dtype} is a quantized (integer/fp8) dtype, which is not "
            "implemented yet; use float32, float16 or bfloat16 for the KV cache"
        )
