"""ALiBi slopes: the per-head factors of the linear attention bias (Press et al., "Train Short, Test Long")."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _geometric(num_heads: int) -> list[float]:
    """num_heads a power of two: 2^(-8/n), 2^(-16/n), ..., 2^-8."""
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]


def alibi_slopes(num_heads: int) -> Tensor:
    """(num_heads,) fp32 slopes, head h's bias being slope[h] * (key_pos - query_pos).

    For a power of two n the slopes are the geometric sequence 2^(-8(h+1)/n). Otherwise the n'
    = 2^floor(log2 n) slopes of n' heads come first, then every other slope of 2n' heads (the ones
    falling between them) until there are n; this is what ALiBi's authors, Bloom and
    Baichuan-13B use.
    """
    if num_heads < 1:
        raise ValueError(f"alibi_slopes needs at least one head, got num_heads={num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric(closest) + _geometric(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
