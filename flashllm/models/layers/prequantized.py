"""GPTQ / AWQ checkpoints: collect each linear layer's packed tensors (this rank's shard) while loading, then build
its QuantizedWeight."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.hf_config import CheckpointQuant, ModelLoadError
from flashllm.models.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.quant import awq, gptq
from flashllm.quant.gptq import WORD_BITS, IntegerWeight, PrequantizedFormatError, default_g_idx

__all__ = ["PrequantizedLinear", "finish_prequantized", "load_prequantized", "prepare_prequantized",
           "split_output_features"]

# `<linear prefix>.<suffix>` tensors of a GPTQ / AWQ layer
REQUIRED_SUFFIXES = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales")}
OPTIONAL_SUFFIXES = {"gptq": ("g_idx",), "awq": ()}
_ATTR = "_packed_checkpoint_weight"  # the PrequantizedLinear of a prepared layer
# "K" / "N": which dimension of each stored tensor runs along the input / output features, and how
# many features one stored element covers there ("word": 32 / bits codes packed in an int32,
# "group": one quantization group); a rank keeps whole words and whole groups only
_LAYOUT = {
    "gptq": {"qweight": {"K": (0, "word"), "N": (1, 1)}, "qzeros": {"K": (0, "group"), "N": (1, "word")},
             "scales": {"K": (0, "group"), "N": (1, 1)}, "g_idx": {"K": (0, 1)}},
    "awq": {"qweight": {"K": (0, 1), "N": (1, "word")}, "qzeros": {"K": (0, "group"), "N": (1, "word")},
            "scales": {"K": (0, "group"), "N": (1, 1)}},
}


class PrequantizedLinear:
    """The packed tensors of one linear layer, per checkpoint shard, until `assemble()`.

    Shard ids are the model's (None for a plain layer, 0..n-1 for the projections fused into
    qkv_proj / gate_up_proj); each shard is unpacked alone and the shards are joined along the
    output features in id order. Under tensor parallelism only this rank's part of each tensor
    is read (the layer's output_shard / input_shard say which): a column-parallel layer keeps its
    output features (whole packed words of them), a row-parallel one its input features (whole
    words and whole quantization groups of them).
    """

    def __init__(self, name: str, layer: LinearBase, quant: CheckpointQuant) -> None:
        self.name, self.quant, self.layer = name, quant, layer
        self.shard_sizes = _shard_sizes(layer)
        self.in_features = layer.input_size_per_partition
        self.device = layer.weight.device
        self.tensors: dict[Any, dict[str, Tensor]] = {}
        k_start, k_size, k_full = layer.input_shard()
        # GPTQ act order scatters a group's input features over K: keep every group's scales and
        # zero points (G x N, small) and pick this rank's groups once g_idx is known (_localize_groups)
        whole_groups = quant.group_size == -1 or (quant.method == "gptq" and quant.desc_act)
        self.group_offset = 0 if whole_groups or k_size == k_full else k_start // quant.group_size
        self._whole_groups = whole_groups

    def add(self, suffix: str, shard_id: Any, tensor: Tensor) -> None:
        """Keep this rank's part of `<prefix>.<suffix>` of shard `shard_id`, read from the checkpoint.

        Refuses unknown suffixes, shards and repeats, and splits that would cut a packed word or a
        quantization group.
        """
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
        shard[suffix] = materialize(self._rank_part(suffix, shard_id, tensor))

    def _rank_part(self, suffix: str, shard_id: Any, tensor: Tensor) -> Tensor:
        """`tensor` narrowed (unread) to this rank's output and input features."""
        _, n_start, n_size, n_full = self.layer.output_shard(shard_id)
        k_start, k_size, k_full = self.layer.input_shard()
        layout = _LAYOUT[self.quant.method][suffix]
        for axis, start, size, full in (("N", n_start, n_size, n_full), ("K", k_start, k_size, k_full)):
            if axis not in layout or size == full:  # one rank, or features this tensor keeps whole
                continue
            dim, unit = layout[axis]
            if unit == "group" and self._whole_groups:
                continue
            per = {"word": WORD_BITS // self.quant.bits, "group": self.quant.group_size}.get(unit, unit)
            self._check_split(suffix, axis, start, size, per, unit)
            if tensor.dim() <= dim or tensor.shape[dim] != full // per:
                raise ModelLoadError(
                    f"{self._where(shard_id)}.{suffix} has shape {tuple(tensor.shape)}: expected {full // per} along "
                    f"dimension {dim} for {full} {'output' if axis == 'N' else 'input'} features; the checkpoint "
                    "does not match its config.json and quantization_config"
                )
            tensor = tensor.narrow(dim, start // per, size // per)
        return tensor

    def _check_split(self, suffix: str, axis: str, start: int, size: int, per: int, unit: Any) -> None:
        if start % per == 0 and size % per == 0:
            return
        tp = self.layer.tp_size
        if unit == "group":
            raise ModelLoadError(
                f"{self.name}: its {size} input features per rank (of {tp} ranks) are not whole quantization groups "
                f"of {per}, so the row-parallel layer cannot be split; choose a tensor_parallel_size that leaves "
                "each rank a multiple of group_size input features, or run one rank"
            )
        what = "output" if axis == "N" else "input"
        raise ModelLoadError(
            f"{self.name}.{suffix}: this rank's {what} features [{start}, {start + size}) of {tp} ranks do not fall on "
            f"whole {per}-feature words of the packed {self.quant.method.upper()} tensors; choose a "
            f"tensor_parallel_size that leaves each rank a multiple of {per} {what} features, or run one rank"
        )

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
            if q.method == "gptq":
                tensors = self._localize_groups(tensors)
            if q.method == "awq":
                return awq.unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size=q.group_size)
            return gptq.unpack_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                    bits=q.bits, group_size=q.group_size, checkpoint_format=q.checkpoint_format)
        except PrequantizedFormatError as exc:
            raise ModelLoadError(f"{self._where(shard_id)}: {exc}") from None

    def _localize_groups(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """A row-parallel rank's GPTQ tensors with g_idx renumbered to the groups this rank holds.

        The rank holds its input features' g_idx; it needs each group it uses whole (all
        group_size features on this rank), which plain group order always gives and act order
        (desc_act) gives only when the quantizer kept groups inside the ranks' feature ranges.
        """
        k_start, k_size, k_full = self.layer.input_shard()
        if k_size == k_full or self.quant.group_size == -1:
            return tensors
        g_idx = tensors.get("g_idx")
        if g_idx is None:
            g_idx = default_g_idx(k_full, self.quant.group_size)[k_start:k_start + k_size]
        if g_idx.is_floating_point():
            raise ModelLoadError(f"{self.name}: g_idx must hold integers, got {g_idx.dtype}")
        local = g_idx.to(torch.int64) - self.group_offset
        used, counts = torch.unique(local, return_counts=True)
        held = tensors["scales"].shape[0]
        if used.numel() and (int(used[0]) < 0 or int(used[-1]) >= held or bool((counts != self.quant.group_size).any())):
            raise ModelLoadError(
                f"{self.name}: its quantization groups (g_idx) mix input features of different tensor-parallel "
                f"ranks, so this row-parallel layer cannot be split over {self.layer.tp_size} ranks (act-order GPTQ "
                "groups features across all of K); run one rank, or use a checkpoint quantized with desc_act=false "
                "or static_groups=true"
            )
        picked = {name: tensors[name].index_select(0, used) for name in ("scales", "qzeros") if name in tensors}
        return {**tensors, **picked, "g_idx": torch.searchsorted(used, local)}

    def _where(self, shard_id: Any) -> str:
        return self.name if shard_id is None else f"{self.name} (shard {shard_id})"


def split_output_features(name: str, tensor: Tensor, sizes: Sequence[int],
                          quant: CheckpointQuant | None) -> list[Tensor]:
    """Checkpoint tensor `name` (`<linear>.<suffix>`) of a projection fused along its outputs (QWen's
    c_attn, Baichuan's W_pack) cut into the projections of `sizes` output features each: unread views.

    weight / bias: rows. GPTQ / AWQ tensors: along their output dimension, in whole packed words;
    g_idx (per input feature) is the same for every projection. Raises ModelLoadError (one line,
    naming the tensor) on a suffix the checkpoint's format does not have, a size off the packed
    words, or a tensor whose output dimension does not hold sum(sizes) features.
    """
    suffix = name.rpartition(".")[2]
    if suffix in ("weight", "bias"):
        dim, per = 0, 1
    else:
        layout = _LAYOUT[quant.method].get(suffix) if quant is not None else None
        if layout is None:
            formats = "a float checkpoint" if quant is None else f"a {quant.method.upper()} checkpoint"
            raise ModelLoadError(f"checkpoint tensor {name!r}: {formats} has no {suffix!r} tensors")
        if "N" not in layout:
            return [tensor] * len(sizes)
        dim, unit = layout["N"]
        per = WORD_BITS // quant.bits if unit == "word" else unit
    total = sum(sizes)
    if any(size % per for size in sizes):
        raise ModelLoadError(f"checkpoint tensor {name!r}: projections of {list(sizes)} output features do not fall "
                             f"on whole {per}-feature packed words, so the fused tensor cannot be split")
    if tensor.dim() <= dim or tensor.shape[dim] != total // per:
        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; expected {total // per} "
                             f"along dimension {dim} ({total} output features: {list(sizes)} fused) as config.json says")
    parts, start = [], 0
    for size in sizes:
        parts.append(tensor.narrow(dim, start // per, size // per))
        start += size
    return parts


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
    Under tensor parallelism each layer collects and reads its rank's shard only.
    """
    if quant is None:
        return
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or getattr(module, "float_in_checkpoints", False):
            continue  # a MoE router: float in GPTQ / AWQ checkpoints too
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
