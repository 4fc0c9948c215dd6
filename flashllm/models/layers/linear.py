"""Linear layers (replicated, column/row tensor-parallel, fused qkv and gate_up) over ops.quant_matmul."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.quant.spec import WeightQuantSpec
from flashllm.quant.weight_only import quantize_weight


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tp_size={denominator}; choose a tensor "
            "parallel size that divides it"
        )
    return numerator // denominator


def copy_checked(param: Tensor, loaded: Tensor, what: str = "weight") -> None:
    """Copy `loaded` into `param` (converting dtype and device), refusing a shape mismatch."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what} has shape {tuple(loaded.shape)} but the model expects {tuple(param.shape)}; "
            "the checkpoint does not match its config.json"
        )
    param.data.copy_(loaded)


def default_weight_loader(param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
    """Weight loader of a parameter that is neither sharded nor fused."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not fused; got shard_id={shard_id!r}")
    copy_checked(param, loaded_weight)


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module):
    """y = x @ W.T + b through `ops.quant_matmul`; W (output_size_per_partition, input_size_per_partition).

    Subclasses decide how a checkpoint tensor maps onto this rank's slice (`weight_loader`).
    `process_weights_after_loading()` must run once after loading: it builds the QuantizedWeight
    the forward passes to the op, which is where weight quantization plugs in.
    """

    def __init__(
        self,
        input_size_per_partition: int,
        output_size_per_partition: int,
        bias: bool,
        ops: Any,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self._quant_matmul = ops.quant_matmul
        shape = (output_size_per_partition, input_size_per_partition)
        self.weight = _new_param(shape, dtype, device, self.weight_loader)
        self.bias = _new_param((output_size_per_partition,), dtype, device, self.weight_loader) if bias else None
        self.qweight: QuantizedWeight | None = None

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def process_weights_after_loading(self, quant: WeightQuantSpec | None = None) -> None:
        """Build the QuantizedWeight the forward multiplies by from the loaded float weight.

        With an enabled `quant` spec the weight is quantized (see flashllm.quant.quantize_weight)
        and the float parameter is dropped, so only the quantized copy stays in memory.
        """
        if quant is None or not quant.enabled:
            self.qweight = QuantizedWeight.dense(self.weight)
            return
        try:
            self.qweight = quantize_weight(self.weight.data, quant.scheme, quant.group_size, quant.symmetric)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__} {tuple(self.weight.shape)}: {err}") from None
        self.weight = None

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.qweight is None:
            raise RuntimeError(
                f"{type(self).__name__} used before process_weights_after_loading(); load the "
                "model with flashllm.models.loader.load_model"
            )
        return self._quant_matmul(x, self.qweight, bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (T, input_size_per_partition) -> (T, output_size_per_partition) in x.dtype."""
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(input_size, output_size, bias, ops, dtype, device, tp_rank, tp_size)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r*N/tp, (r+1)*N/tp) of W and b."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        out = _divide(output_size, tp_size, "output_size")
        super().__init__(input_size, out, bias, ops, dtype, device, tp_rank, tp_size)

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        if self.tp_size > 1:
            size = param.shape[0]
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        copy_checked(param, loaded_weight)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    The bias is held whole by every rank and added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        inp = _divide(input_size, tp_size, "input_size")
        super().__init__(inp, output_size, bias, ops, dtype, device, tp_rank, tp_size)

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        if self.tp_size > 1 and param.dim() == 2:
            size = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * size, size)
        copy_checked(param, loaded_weight)

    def forward(self, x: Tensor) -> Tensor:
        """x (T, input_size / tp) -> (T, output_size), summed over ranks."""
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        out = self._matmul(x, None)
        torch.distributed.all_reduce(out)
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate_up_proj).

    Checkpoint shard `shard_id` (an index into `output_sizes`) lands at its offset in this rank's
    slice, so the output is [shard0 | shard1 | ...] per rank.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = [_divide(n, tp_size, "output_size") for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, ops, dtype, device, tp_rank, tp_size)

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnParallelLinear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        if self.tp_size > 1:
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        copy_checked(param.narrow(0, offset, size), loaded_weight, f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused: output [q (Hq*D) | k (Hk*D) | v (Hk*D)] per rank.

    Query heads are split across ranks; key/value heads too, or replicated when there are fewer
    of them than ranks (rank r then holds kv head r * Hk // tp).
    """

    _SHARD_INDEX = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        else:
            _divide(tp_size, total_num_kv_heads, "tp_size (replicating kv heads)")
            self.num_kv_heads = 1
        if tp_size > total_num_kv_heads:
            # tp_size // Hk consecutive ranks share one kv head
            self._kv_head_start = tp_rank * total_num_kv_heads // tp_size
        else:
            self._kv_head_start = tp_rank * self.num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, ops, dtype, device, tp_rank, tp_size)

    def weight_loader(self, param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
        index = self._SHARD_INDEX.get(shard_id, shard_id) if isinstance(shard_id, str) else shard_id
        if index not in (0, 1, 2):
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k', 'v' (or 0-2), got {shard_id!r}")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = ((0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size))[index]
        if self.tp_size > 1:
            start = self.tp_rank * q_size if index == 0 else self._kv_head_start * self.head_dim
            loaded_weight = loaded_weight.narrow(0, start, size)
        copy_checked(param.narrow(0, offset, size), loaded_weight, "qkv"[index] + "_proj")
