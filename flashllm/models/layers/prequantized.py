"""GPTQ / AWQ checkpoints: collect each linear layer's packed tensors while loading, then build its QuantizedWeight."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from flashllm.models.hf_config import CheckpointQuant, ModelLoadError
from flashllm.models.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.quant import awq, gptq
from flashllm.quant.gptq import IntegerWeight, PrequantizedFormatError

__all__ = ["PrequantizedLinear", "finish_prequantized", "load_prequantized", "prepare_prequantized"]

# `<linear prefix>.<suffix>` tensors of a GPTQ / AWQ layer
REQUIRED_SUFFIXES = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales")}
OPTIONAL_SUFFIXES = {"gptq": ("g_idx",), "awq": ()}
_ATTR = "_packed_checkpoint_weight"  # the PrequantizedLinear of a prepared layer


class PrequantizedLinear:
    """The packed tensors of one linear layer, per checkpoint shard, until `assemble()`.

    Shard ids are the model's (None for a plain layer, 0..n-1 for the projections fused into
    qkv_proj / gate_up_proj); each shard is unpacked alone and the shards are joined along the
    output features in id order.
    """

    def __init__(self, name: str, layer: LinearBase, quant: CheckpointQuant) -> None:
        self.name, self.quant = name, quant
        self.shard_sizes = _shard_sizes(layer)
        self.in_features = layer.input_size_per_partition
        self.device = layer.weight.device
        self.tensors: dict[Any, dict[str, Tensor]] = {}

    def add(self, suffix: str, shard_id: Any, tensor: Tensor) -> None:
        """Keep `<prefix>.<suffix>` of shard `shard_id`; refuses unknown suffixes, shards and repeats."""
        known = REQUIRED_SUFFIXES[self.quant.method] + OPTIONAL_SUFFIXES[self.quant.method]
        if suffix not in known:
            raise ModelLoadError(
                f"{self.name}.{suffix}: a {self.quant.method.upper()} checkpoint stores this linear layer as "
                f"{', '.join(known)}; checkpoints that leave some linears unquantized are not supported"
            )
        if shard_id not in self.shard_sizes:
            raise ModelLoadError(f"{self.name}: shard {shard_id!r} is not one of {list(self.shard_sizes)}")
        shard = self.tensors.setdefault(shard_id, {})
        if suffix in shard:
            raise ModelLoadError(f"{self.name}.{suffix} (shard {shard_id!r}) appears twice in the checkpoint")
        shard[suffix] = tensor

    def assemble(self) -> QuantizedWeight:
        """The layer's QuantizedWeight (on the CPU), the shards' weights side by side along N."""
        shards = []
        for shard_id, size in self.shard_sizes.items():
            weight = self._unpack(shard_id)
            if tuple(weight.codes.shape) != (size, self.in_features):
                raise ModelLoadError(
                    f"{self._where(shard_id)} unpacks to a ({weight.codes.shape[0]}, {weight.codes.shape[1]}) weight, "
                    f"expected ({size}, {self.in_features}); the checkpoint does not match its config.json"
                )
            shards.append(weight)
        try:
            joined = shards[0] if len(shards) == 1 else gptq.concat_output_shards(shards)
            return gptq.to_quantized_weight(joined)
        except PrequantizedFormatError as exc:
            raise ModelLoadError(f"{self.name}: {exc}") from None

    def _unpack(self, shard_id: Any) -> IntegerWeight:
        tensors = self.tensors.get(shard_id, {})
        missing = [s for s in REQUIRED_SUFFIXES[self.quant.method] if s not in tensors]
        if self.quant.method == "gptq" and self.quant.desc_act and "g_idx" not in tensors:
            missing.append("g_idx")  # act order: without it the groups of the input features are unknown
        if missing:
            raise ModelLoadError(f"{self._where(shard_id)} is missing {', '.join(missing)} in the {self.quant.method} "
                                 "checkpoint; the weights are incomplete")
        q = self.quant
        try:
            if q.method == "awq":
                return awq.unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size=q.group_size)
            return gptq.unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                    bits=q.bits, group_size=q.group_size, checkpoint_format=q.checkpoint_format)
        except PrequantizedFormatError as exc:
            raise ModelLoadError(f"{self._where(shard_id)}: {exc}") from None

    def _where(self, shard_id: Any) -> str:
        return self.name if shard_id is None else f"{self.name} (shard {shard_id})"


def _shard_sizes(layer: LinearBase) -> dict[Any, int]:
    """shard id -> output features of that projection in this fused layer ({None: N} when unfused)."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return {0: q, 1: kv, 2: kv}
    if isinstance(layer, MergedColumnParallelLinear):
        return dict(enumerate(layer.output_sizes))
    return {None: layer.output_size_per_partition}


def prepare_prequantized(model: nn.Module, quant: CheckpointQuant | None) -> None:
    """Make every linear layer of `model` take GPTQ / AWQ tensors instead of a float weight.

    The float `weight` parameters are dropped (never allocated twice); biases load as usual.
    Tensor parallelism is refused: the packed tensors would need slicing across ranks.
    """
    if quant is None:
        return
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        if module.tp_size > 1:
            raise ModelLoadError(f"{quant.method} checkpoints load with tensor parallel size 1 only (got "
                                 f"{module.tp_size}); run one rank or quantize a float checkpoint with --quant_type")
        setattr(module, _ATTR, PrequantizedLinear(name, module, quant))
        module.weight = None


def load_prequantized(model: nn.Module, param_name: str, tensor: Tensor, shard_id: Any) -> bool:
    """Route `<linear prefix>.<qweight|qzeros|scales|g_idx>` to its layer; False if no such layer takes it."""
    prefix, _, suffix = param_name.rpartition(".")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return False
    collector = getattr(module, _ATTR, None)
    if not isinstance(collector, PrequantizedLinear):
        return False
    collector.add(suffix, shard_id, tensor)
    return True


def finish_prequantized(module: nn.Module) -> bool:
    """Give a prepared linear layer its QuantizedWeight on its device; False for any other module."""
    collector = getattr(module, _ATTR, None)
    if not isinstance(collector, PrequantizedLinear):
        return False
    weight = collector.assemble()
    moved = {f: getattr(weight, f).to(collector.device) for f in ("data", "scales", "zeros", "input_perm")
             if getattr(weight, f) is not None}
    module.qweight = dataclasses.replace(weight, **moved)
    delattr(module, _ATTR)
    return True
