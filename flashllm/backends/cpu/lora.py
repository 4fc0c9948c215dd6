"""cpu kernels of the batched LoRA ops: rows grouped by adapter slot, one GEMM per slot in use."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Every LoRA layer of a step gets the same indices tensor (a new one each step): its row groups are
# found once, by identity, instead of once per layer and shard.
_last: list[Any] = [None, None]


def _groups(lora_indices: Tensor) -> list[tuple[int, slice | Tensor]]:
    """(slot, rows) per adapter slot present (never -1); rows is a slice when one slot takes the whole batch."""
    if _last[0] is lora_indices:
        return _last[1]
    groups = _find_groups(lora_indices)
    _last[0], _last[1] = lora_indices, groups
    return groups


def _find_groups(lora_indices: Tensor) -> list[tuple[int, slice | Tensor]]:
    if lora_indices.numel() == 0:
        return []
    first, last = int(lora_indices[0]), int(lora_indices[-1])
    if first == last and bool((lora_indices == first).all()):  # one adapter (or none) for the whole batch
        return [] if first < 0 else [(first, slice(None))]
    groups: list[tuple[int, slice | Tensor]] = []
    for slot in torch.unique(lora_indices).tolist():
        if slot >= 0:
            groups.append((slot, (lora_indices == slot).nonzero().squeeze(1)))
    return groups


def lora_shrink(x: Tensor, lora_a: Tensor, lora_indices: Tensor) -> Tensor:
    """h (T, R) in x.dtype = x @ A_slot^T per row's slot (fp32 sums), zero for -1 rows (see the op spec)."""
    h = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=x.dtype, device=x.device)
    for slot, rows in _groups(lora_indices):
        h[rows] = (x[rows].float() @ lora_a[slot].float().T).to(x.dtype)
    return h


def lora_expand(out: Tensor, h: Tensor, lora_b: Tensor, lora_indices: Tensor, offset: int) -> Tensor:
    """out[:, offset:offset + N] += h @ B_slot^T per row's slot, -1 rows untouched (see the op spec)."""
    n = lora_b.shape[1]
    if offset < 0 or offset + n > out.shape[1]:
        raise ValueError(f"lora_expand: slice [{offset}, {offset + n}) does not fit out's {out.shape[1]} columns")
    target = out[:, offset:offset + n]
    for slot, rows in _groups(lora_indices):
        delta = h[rows].float() @ lora_b[slot].float().T
        target[rows] = (target[rows].float() + delta).to(out.dtype)
    return out
