"""gelu_and_mul: the GeGLU gate, gelu(gate) * up, over a fused gate_up projection."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

USES: frozenset[str] = frozenset()

_APPROXIMATIONS = ("none", "tanh")


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """Gated activation `gelu(x[:, :I], approximate) * x[:, I:]`.

    Shapes: x (T, 2I) float, gate columns first then up columns; returns (T, I) in x.dtype.
    `approximate` is "none" (exact erf GELU) or "tanh" (the tanh approximation, what Gemma's
    `gelu_pytorch_tanh` means). Computed in fp32 and cast once at the end.
    """
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"gelu_and_mul: approximate={approximate!r} is not supported; use one of {_APPROXIMATIONS}")
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"gelu_and_mul: last dimension {x.shape[-1]} is odd; expected 2 * intermediate_size "
            "(gate columns followed by up columns)"
        )
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate=approximate) * up).to(x.dtype)
