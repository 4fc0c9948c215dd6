"""MLPs: the gated (SwiGLU) one (fused gate_up projection, ops.silu_and_mul, down projection) and the plain
two-projection one of GPT-2-style families (StarCoder 2, Arcee)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with gate and up fused into gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, ops, dtype, device,
            tp_rank, tp_size,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, ops, dtype, device, tp_rank, tp_size
        )
        self._silu_and_mul = ops.silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.down_proj(self._silu_and_mul(self.gate_up_proj(x)))


# config.json hidden_act values of an ungated MLP -> the elementwise activation (transformers' ACT2FN meanings)
PLAIN_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),  # the same tanh formula, written out (SantaCoder's)
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # Arcee's, Nemotron's
}


class PlainMLP(nn.Module):
    """down_proj(act(up_proj(x))): no gate, `act` one of PLAIN_ACTIVATIONS applied in x.dtype elementwise (so it
    runs as it is on every device and on each tensor-parallel rank's slice of the intermediate features), or an
    elementwise module with learned scalars (Apertus' xIELU), held as `act_fn` as checkpoints name it."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str | nn.Module, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        learned = isinstance(activation, nn.Module)
        if not learned and activation not in PLAIN_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(PLAIN_ACTIVATIONS)}")
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, ops, dtype, device, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, ops, dtype, device, tp_rank, tp_size)
        self.act_fn = activation if learned else None
        self.activation = type(activation).__name__ if learned else activation
        self._act = activation.forward if learned else PLAIN_ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        return self.down_proj(self._act(self.up_proj(x)))
