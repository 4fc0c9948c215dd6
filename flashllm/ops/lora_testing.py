"""Input cases of the batched LoRA ops (lora_shrink, lora_expand) for conformance tests."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

Inputs = dict[str, Any]


class LoRACase(NamedTuple):
    """T rows over L adapter slots of rank R; K input features; the output slice [offset, offset + N) of N_out."""

    tokens: int
    in_features: int
    rank: int
    slots: int
    out_features: int
    offset: int
    out_total: int
    pattern: str  # "mixed": every slot and -1 present, shuffled; "one": every row slot 1; "none": all -1; "runs"


LORA_CASES: dict[str, LoRACase] = {
    "mixed": LoRACase(13, 96, 16, 4, 48, 32, 128, "mixed"),
    "one_adapter": LoRACase(5, 64, 8, 3, 64, 0, 64, "one"),
    "no_adapter": LoRACase(4, 64, 8, 2, 32, 16, 64, "none"),
    "decode_runs": LoRACase(8, 64, 16, 4, 40, 8, 56, "runs"),
}


def lora_indices(gen: torch.Generator, c: LoRACase) -> Tensor:
    """(T,) int64 slot per row for the case's pattern."""
    if c.pattern == "one":
        return torch.ones(c.tokens, dtype=torch.int64)
    if c.pattern == "none":
        return torch.full((c.tokens,), -1, dtype=torch.int64)
    if c.pattern == "runs":
        return torch.tensor([0, 0, 1, 1, -1, 3, 3, 3], dtype=torch.int64)[:c.tokens]
    base = torch.arange(-1, c.slots).repeat(c.tokens // (c.slots + 1) + 1)[:c.tokens]
    return base[torch.randperm(c.tokens, generator=gen)]


def _randn(gen: torch.Generator, *shape: int, std: float, dtype: torch.dtype, device: str) -> Tensor:
    return (torch.randn(shape, generator=gen) * std).to(dtype=dtype, device=device)


def shrink_inputs(gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int,
                  case: str) -> Inputs:
    """x (T, K), lora_a (L, R, K), lora_indices (T,)."""
    c = LORA_CASES[case]
    return {
        "x": _randn(gen, c.tokens, c.in_features, std=1.0, dtype=dtype, device=device),
        "lora_a": _randn(gen, c.slots, c.rank, c.in_features, std=c.in_features**-0.5, dtype=dtype, device=device),
        "lora_indices": lora_indices(gen, c).to(device),
    }


def expand_inputs(gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int,
                  case: str) -> Inputs:
    """out (T, N_out), h (T, R), lora_b (L, N, R), lora_indices (T,), offset."""
    c = LORA_CASES[case]
    return {
        "out": _randn(gen, c.tokens, c.out_total, std=1.0, dtype=dtype, device=device),
        "h": _randn(gen, c.tokens, c.rank, std=1.0, dtype=dtype, device=device),
        "lora_b": _randn(gen, c.slots, c.out_features, c.rank, std=c.rank**-0.5, dtype=dtype, device=device),
        "lora_indices": lora_indices(gen, c).to(device),
        "offset": c.offset,
    }
