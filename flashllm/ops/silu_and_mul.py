"""silu_and_mul: the SwiGLU gate, silu(gate) * up, over a fused gate_up projection."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

USES: frozenset[str] = frozenset()


def silu_and_mul(x: Tensor) -> Tensor:
    """Gated activation `silu(x[:, :I]) * x[:, I:]`.

    Shapes: x (T, 2I) float, gate columns first then up columns (the fused gate_up layout);
    returns (T, I) in x.dtype. Computed in fp32 and cast once at the end.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"silu_and_mul: last dimension {x.shape[-1]} is odd; expected 2 * intermediate_size "
            "(gate columns followed by up columns)"
        )
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
