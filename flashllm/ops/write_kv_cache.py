"""write_kv_cache: store the new tokens' keys and values into their slots of the paged KV cache."""

from __future__ import annotations

from torch import Tensor

from flashllm.ops._kv_checks import reject_quantized_kv

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
    k_scale / v_scale are reserved for quantized caches: passing one, or a cache in an
    integer/fp8 dtype, raises NotImplementedError.
    """
    reject_quantized_kv("write_kv_cache", k_cache, k_scale, v_scale)
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(
            f"write_kv_cache: slot {int(slots.max())} is out of range for a cache of {num_blocks} "
            f"blocks of {block_size}; expected slots in [0, {num_blocks * block_size}) or -1"
        )
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)
