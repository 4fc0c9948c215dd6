"""Random paged-KV block tables and seeded tensors for the ops' conformance inputs (ops/testing.py,
ops/testing_latent.py, ops/testing_experts.py)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def random_block_tables(
    gen: torch.Generator, seq_lens: list[int], block_size: int, spare_blocks: int = 3
) -> tuple[Tensor, int]:
    """Block tables (B, max_blocks) int32 over a shuffled pool, and the pool's num_blocks.

    Blocks are drawn from a random permutation of the pool so no sequence gets contiguous or
    ascending blocks; `spare_blocks` unused blocks stay in the pool, and each row is padded with
    one extra 0 entry so kernels cannot rely on the table width.
    """
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq, default=0) + 1, dtype=torch.int32)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    return tables, num_blocks


def seeded_randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str, std: float = 1.0) -> Tensor:
    """Normal values of `std` from `gen`, drawn in fp32 on the CPU so a seed gives the same values on every device
    and dtype, then moved to `device` as `dtype`."""
    return (torch.randn(shape, generator=gen) * std).to(device=device, dtype=dtype)
