"""write_kv_cache: store the new tokens' keys and values into their slots of the paged KV cache."""

from __future__ import annotations

from torch import Tensor

from flashllm.ops._kv_checks import check_kv_scales, dynamic_scales, quantize_kv, static_scale_view

USES: frozenset[str] = frozenset({"kv_dtype", "head_size", "block_size"})


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Copy token t's key and value into slot `slot_mapping[t]` of the caches, in place.

    Shapes: k, v (T, Hk, D); k_cache, v_cache (num_blocks, block_size, Hk, D);
    slot_mapping (T,) int64 with slot = block * block_size + offset, or -1 for a token whose
    key/value must not be written (padding). Values are cast to the cache dtype; every other
    slot is left untouched. Two tokens must not share a slot (the result would be undefined).

    Quantized caches (torch.int8, torch.float8_e4m3fn) need k_scale and v_scale, float32:
    * dynamic, scale caches (num_blocks, block_size, Hk): each written (slot, head) gets
      scale = max|x| over D / qmax (qmax 127 for int8, 448 for e4m3; at least 1e-10) and
      codes x / scale, so the largest element maps to +-qmax.
    * static, () or (Hk,): calibrated and read-only; codes x / scale, saturating at +-qmax.
    int8 codes round half to even; fp8 codes round to the nearest e4m3 value (see _kv_checks).
    A float cache given scales, or a quantized cache without them, raises ValueError.
    """
    mode = check_kv_scales("write_kv_cache", k_cache, k_scale, v_scale)
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(
            f"write_kv_cache: slot {int(slots.max())} is out of range for a cache of {num_blocks} "
            f"blocks of {block_size}; expected slots in [0, {num_blocks * block_size}) or -1"
        )
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scale in ((k[valid], k_cache, k_scale), (v[valid], v_cache, v_scale)):
        if mode == "none":
            cache[blocks, offsets] = x.to(cache.dtype)
        elif mode == "dynamic":
            row_scales = dynamic_scales(x, cache.dtype)  # (n, Hk)
            cache[blocks, offsets] = quantize_kv(x, row_scales.unsqueeze(-1), cache.dtype)
            scale[blocks, offsets] = row_scales
        else:
            cache[blocks, offsets] = quantize_kv(x, static_scale_view(scale), cache.dtype)
