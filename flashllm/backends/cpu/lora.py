"""cpu kernels of the batched LoRA ops: a few rows (decode steps) take every adapter in use in one batched
product; many rows (prefill) are grouped by adapter slot, one GEMM per slot in use."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Up to this many rows, every row is multiplied by every adapter in use (a handful of large ops; the
# extra products are small next to the per-op cost at decode sizes). Above it, rows are grouped by
# slot so each row meets only its own adapter (prefill, where the products dominate).
DENSE_MAX_ROWS = 128

# Every LoRA layer of a step gets the same indices tensor (a new one each step): its row groups are
# found once, by identity, instead of once per layer and shard.
_last: list[Any] = [None, None]
_last_dense: list[Any] = [None, None]


def _groups(lora_indices: Tensor) -> list[tuple[int, slice | Tensor]]:
    """(slot, rows) per adapter slot present (never -1); rows is a slice when one slot takes the whole batch."""
    if _last[0] is lora_indices:
        return _last[1]
    groups = _find_groups(lora_indices)
    _last[0], _last[1] = lora_indices, groups
    return groups


def _dense_plan(lora_indices: Tensor, num_slots: int) -> tuple[Tensor | None, Tensor, Tensor]:
    """(slots in use, or None when every slot is; each row's position among them (0 for -1 rows);
    (T, U) float 0/1 selector, all zero on -1 rows), cached for the step's indices tensor."""
    if _last_dense[0] is lora_indices:
        return _last_dense[1]
    used = torch.unique(lora_indices[lora_indices >= 0])
    if used.numel() == num_slots:
        position, chosen = lora_indices.clamp(min=0), None
    else:
        lookup = torch.zeros(num_slots, dtype=torch.int64, device=lora_indices.device)
        lookup[used] = torch.arange(used.numel(), device=lora_indices.device)
        position, chosen = lookup[lora_indices.clamp(min=0)], used
    selector = torch.zeros((lora_indices.numel(), max(used.numel(), 1)), dtype=torch.float32,
                           device=lora_indices.device)
    rows = (lora_indices >= 0).nonzero().squeeze(1)
    selector[rows, position[rows]] = 1.0
    plan = (chosen, position, selector)
    _last_dense[0], _last_dense[1] = lora_indices, plan
    return plan


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
    if 0 < x.shape[0] <= DENSE_MAX_ROWS and bool((lora_indices >= 0).any()):
        chosen, position, selector = _dense_plan(lora_indices, lora_a.shape[0])
        a = lora_a if chosen is None else lora_a[chosen]  # (U, R, K)
        every = x.float() @ a.reshape(-1, a.shape[2]).float().T  # (T, U * R): each row under every adapter
        picked = every.view(x.shape[0], a.shape[0], a.shape[1])[torch.arange(x.shape[0]), position]
        return (picked * selector.sum(1, keepdim=True)).to(x.dtype)  # -1 rows: zero
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
    if 0 < out.shape[0] <= DENSE_MAX_ROWS and bool((lora_indices >= 0).any()):
        chosen, _, selector = _dense_plan(lora_indices, lora_b.shape[0])
        b = lora_b if chosen is None else lora_b[chosen]  # (U, N, R)
        spread = selector.T[:, :, None] * h.float()[None]  # (U, T, R): row t's h under its adapter only
        delta = torch.bmm(spread, b.float().transpose(1, 2)).sum(0)  # (T, N); zero on -1 rows
        if out.dtype == torch.float32:
            target.add_(delta)
        else:
            target.copy_((target.float() + delta).to(out.dtype))
        return out
    for slot, rows in _groups(lora_indices):
        delta = h[rows].float() @ lora_b[slot].float().T
        target[rows] = (target[rows].float() + delta).to(out.dtype)
    return out
