"""Random valid inputs for latent_attention (MLA): prefill, chunks after a cached prefix, decode, both forms."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flashllm.ops.testing_blocks import random_block_tables

Inputs = dict[str, Any]

# case -> (q_lens, seq_lens, absorbed); the context of a chunk or decode sits in the cache already
_LAYOUTS: dict[str, tuple[list[int], list[int], bool]] = {
    "mixed": ([5, 1, 17, 1], [5, 40, 33, 17], True),
    "mixed_naive": ([5, 1, 17, 1], [5, 40, 33, 17], False),
    "decode": ([1, 1, 1], [1, 16, 47], True),
    "decode_naive": ([1, 1, 1], [1, 16, 47], False),
    "prefill_block_edges": ([16, 32], [16, 32], True),
    "cached_prefix_with_padding": ([7, 3], [39, 3], True),
}
# (heads, kv_lora_rank L, qk_rope_head_dim R, qk_nope_head_dim Dn, v_head_dim Dv): odd heads, Dn != Dv
LATENT_DIMS = (5, 64, 16, 32, 48)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str, std: float = 1.0) -> Tensor:
    # drawn in fp32 on the CPU, as ops.testing does, so a seed gives the same values everywhere
    return (torch.randn(shape, generator=gen) * std).to(device=device, dtype=dtype)


def latent_attention_inputs(gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int,
                            case: str) -> Inputs:
    """Keyword arguments of one latent_attention call (head_size is not used: MLA's sizes are LATENT_DIMS)."""
    q_lens, seq_lens, absorbed = _LAYOUTS[case]
    heads, rank, rope, nope, v_dim = LATENT_DIMS
    tables, num_blocks = random_block_tables(gen, seq_lens, block_size)
    slots = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        slots += [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    if case == "cached_prefix_with_padding":
        slots[-1] = -1  # a padding token: not written, its slot keeps the (random) cached row
    tokens = sum(q_lens)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": randn(gen, tokens, heads, nope + rope, dtype=dtype, device=device),
        "latent": randn(gen, tokens, rank + rope, dtype=dtype, device=device),
        "kv_cache": randn(gen, num_blocks, block_size, rank + rope, dtype=dtype, device=device),
        "kv_b_weight": randn(gen, heads, nope + v_dim, rank, dtype=dtype, device=device, std=rank**-0.5),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=device),
        "block_tables": tables.to(device),
        "cu_seqlens_q": cu_seqlens_q.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": (nope + rope) ** -0.5,
        "absorbed": absorbed,
    }


LATENT_CASES = tuple(_LAYOUTS)
