"""LoRA-aware linear layers: per-layer adapter slot tables and the batched shrink / expand after the base matmul."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear


class LoRAContext:
    """What every LoRA layer of one model reads at each forward: the batch's per-token adapter slots.

    indices: (T,) int64 on the model's device, the slot of each token's adapter or -1; None when
    no token of the step has an adapter (the layers then do nothing beyond the base matmul).
    """

    def __init__(self) -> None:
        self.indices: Tensor | None = None


class LinearLoRA:
    """The adapter slot table of one linear layer: A (max_loras, S * R, K) and per-shard B (max_loras, N_s, R).

    S is the number of checkpoint projections the layer fuses (3 for qkv_proj, 2 for gate_up_proj,
    else 1); shard s of slot i holds an adapter's A in rows [s * R, s * R + r) and its B, with the
    LoRA scale folded in, in the first r columns (the rest stay zero, so smaller ranks need no mask).
    Under tensor parallelism the table holds this rank's part, cut as the layer cuts its weight: a
    column-parallel layer's B rows of its output shard (A whole), a row-parallel layer's A columns of
    its input shard (B whole). The row-parallel layer's shrink is then a partial sum, all-reduced
    (T x S * R values) before the expand adds the delta to the reduced output.
    """

    def __init__(self, layer: LinearBase, context: LoRAContext, ops: Any, max_loras: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        self.context = context
        self.max_rank = max_rank
        self._shrink, self._expand = ops.lora_shrink, ops.lora_expand
        device = _device_of(layer)
        shards = _shard_ids(layer)
        self.shards: list[tuple[int, int]] = []  # (offset in the output, rows) per shard
        for shard in shards:
            offset, _, rows, _ = layer.output_shard(shard)
            self.shards.append((offset, rows))
        self.in_features = layer.input_size_per_partition
        self.shard_ids = shards
        # (first checkpoint row, rows, checkpoint rows) per shard; (first column, columns, checkpoint columns)
        self._rows = [layer.output_shard(shard)[1:] for shard in shards]
        self._columns = layer.input_shard()
        self._reduce = layer.tp_size > 1 and getattr(layer, "input_is_sharded", False)
        self.lora_a = torch.zeros((max_loras, len(shards) * max_rank, self.in_features), dtype=dtype, device=device)
        self.lora_b = [torch.zeros((max_loras, rows, max_rank), dtype=dtype, device=device) for _, rows in self.shards]

    def shard_index(self, shard_id: Any) -> int:
        """Position of checkpoint shard `shard_id` (None, an int or 'q'/'k'/'v') among this layer's shards."""
        if shard_id is None:
            return 0
        if isinstance(shard_id, str):
            shard_id = QKVParallelLinear._SHARD_INDEX[shard_id]
        return int(shard_id)

    def clear(self, slot: int) -> None:
        """Zero slot `slot` (an adapter leaving it)."""
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()

    def set(self, slot: int, shard: int, lora_a: Tensor, lora_b: Tensor) -> None:
        """Write one projection of an adapter into slot `slot`: lora_a (r, K), lora_b (N_s, r) with the scale
        folded in, as the checkpoint's projection is shaped (this rank's part is cut here)."""
        rank = lora_a.shape[0]
        if rank > self.max_rank:
            raise ValueError(f"adapter rank {rank} is above --max-lora-rank {self.max_rank}")
        first, rows, full_rows = self._rows[shard]
        first_column, columns, full_columns = self._columns
        if tuple(lora_b.shape) != (full_rows, rank) or tuple(lora_a.shape) != (rank, full_columns):
            raise ValueError(f"LoRA shard {shard}: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit "
                             f"a ({full_rows}, {full_columns}) weight at rank {rank}")
        lora_b, lora_a = lora_b.narrow(0, first, rows), lora_a.narrow(1, first_column, columns)
        start = shard * self.max_rank
        self.lora_a[slot, start:start + rank].copy_(lora_a)
        self.lora_b[shard][slot, :, :rank].copy_(lora_b)

    def apply(self, x: Tensor, out: Tensor, indices: Tensor) -> None:
        """out (T, N) += each row's adapter delta, in place: one shrink for every shard, one expand per shard."""
        h = self._shrink(x, self.lora_a, indices)  # (T, S * R)
        if self._reduce:  # this rank's input features only: the ranks' partial products sum to x @ A^T
            torch.distributed.all_reduce(h)
        r = self.max_rank
        for s, ((offset, _), lora_b) in enumerate(zip(self.shards, self.lora_b, strict=True)):
            self._expand(out, h[:, s * r:(s + 1) * r], lora_b, indices, offset)

    def nbytes(self) -> int:
        """Bytes the slot table takes on the device."""
        return self.lora_a.nbytes + sum(b.nbytes for b in self.lora_b)


def _shard_ids(layer: LinearBase) -> list[Any]:
    if isinstance(layer, QKVParallelLinear):
        return [0, 1, 2]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def _device_of(layer: nn.Module) -> torch.device:
    for tensor in (*layer.parameters(), *layer.buffers()):
        return tensor.device
    qweight = getattr(layer, "qweight", None)
    return qweight.data.device if qweight is not None else torch.device("cpu")


def _lora_forward(self: LinearBase, x: Tensor) -> Tensor:
    """The layer's own forward, then its adapters' deltas for the rows that have one."""
    out = type(self).forward(self, x)
    indices = self.lora.context.indices
    if indices is not None:
        self.lora.apply(x, out, indices)
    return out


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LinearBase]]:
    """The linear layers of `model`'s decoder that LoRA can adapt (every LinearBase), by name."""
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            yield name, module


def enable_lora(model: nn.Module, ops: Any, max_loras: int, max_rank: int, dtype: torch.dtype) -> LoRAContext:
    """Give every linear layer of `model` an adapter slot table (`layer.lora`) and the LoRA forward.

    dtype: the activation dtype (the tables' dtype). Only the instances change: a model without
    enable_lora runs its layers' forward untouched. Returns the context the runner fills with each
    step's per-token slots (under tensor parallelism every rank's context gets the same slots).
    """
    context = LoRAContext()
    for _, layer in lora_layers(model):
        layer.lora = LinearLoRA(layer, context, ops, max_loras, max_rank, dtype)
        layer.forward = types.MethodType(_lora_forward, layer)
    model.lora_context = context
    return context


def lora_target(model: nn.Module, weight_name: str) -> tuple[LinearLoRA, int] | None:
    """The slot table and shard a checkpoint weight (`model.layers.0.self_attn.q_proj.weight`) maps to, or None."""
    param_name, shard_id = model._param_target(weight_name)
    module_name = param_name.removesuffix(".weight")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    table = getattr(module, "lora", None)
    if not isinstance(table, LinearLoRA):
        return None
    return table, table.shard_index(shard_id)
