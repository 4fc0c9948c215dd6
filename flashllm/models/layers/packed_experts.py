"""GPTQ / AWQ MoE experts: each expert projection's packed tensors turned into the float weight they stand for."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.hf_config import CheckpointQuant, ModelLoadError
from flashllm.quant import awq, gptq
from flashllm.quant.gptq import PrequantizedFormatError, default_g_idx

# `<...>.experts.<e>.<projection>.<packed tensor>` of a per-expert checkpoint (Mixtral's, Qwen-MoE's)
_PACKED_EXPERT = re.compile(r"^(?P<linear>.+\.experts\.\d+\.(?:w1|w3|w2|gate_proj|up_proj|down_proj))"
                            r"\.(?P<part>qweight|qzeros|scales|g_idx)$")
_REQUIRED = ("qweight", "qzeros", "scales")


def dequantized_experts(weights: Iterable[tuple[str, Tensor]], quant: CheckpointQuant | None,
                        held: Callable[[str], bool] | None = None) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors with every packed expert projection replaced by `<linear>.weight`, the fp32
    (N, K) weight its integers stand for, yielded once its tensors have all arrived (so only projections in
    flight are held); every other tensor passes through unchanged. The experts then load as a float
    checkpoint's do, and --quant_type / --moe_quant_type may quantize them again for the fused_moe kernel.
    held(linear): whether this rank holds that projection's expert (expert parallelism); the packed tensors of
    one it does not hold are dropped unread.

    Raises ModelLoadError naming the projection on a repeated or missing tensor, packed tensors that do
    not fit the quantization_config, or a g_idx (read after the rest) that is not the plain group order.
    """
    if quant is None:
        yield from weights
        return
    pending: dict[str, dict[str, Tensor]] = {}
    finished: dict[str, int] = {}  # projection -> its input features, for a g_idx read after the weight
    for name, tensor in weights:
        match = _PACKED_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        linear, part = match["linear"], match["part"]
        if held is not None and not held(linear):
            continue
        if part == "g_idx" and quant.method == "awq":
            raise ModelLoadError(f"{name}: an AWQ checkpoint has no g_idx; the quantization_config says awq")
        if linear in finished:
            _check_late_g_idx(name, materialize(tensor), finished[linear], quant, part)
            continue
        parts = pending.setdefault(linear, {})
        if part in parts:
            raise ModelLoadError(f"{name} appears twice in the checkpoint")
        parts[part] = materialize(tensor)
        needs_g_idx = quant.method == "gptq" and quant.desc_act
        if all(p in parts for p in _REQUIRED) and (not needs_g_idx or "g_idx" in parts):
            weight = _dequantize(linear, pending.pop(linear), quant)
            finished[linear] = weight.shape[1]
            yield f"{linear}.weight", weight
    if pending:
        linear, parts = next(iter(pending.items()))
        missing = [p for p in (*_REQUIRED, "g_idx") if p not in parts and (p != "g_idx" or quant.desc_act)]
        raise ModelLoadError(f"{linear} is missing {', '.join(missing)} in the {quant.method} checkpoint "
                             f"({len(pending)} expert projection(s) incomplete); the weights are incomplete")


def _dequantize(linear: str, parts: dict[str, Tensor], quant: CheckpointQuant) -> Tensor:
    try:
        if quant.method == "awq":
            weight = awq.unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"], group_size=quant.group_size)
        else:
            weight = gptq.unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                                      bits=quant.bits, group_size=quant.group_size,
                                      checkpoint_format=quant.checkpoint_format)
    except PrequantizedFormatError as exc:
        raise ModelLoadError(f"{linear}: {exc}") from None
    return weight.dequantize()


def _check_late_g_idx(name: str, g_idx: Tensor, in_features: int, quant: CheckpointQuant, part: str) -> None:
    """A g_idx read after its projection was built (without act order): it must be the plain order used."""
    if part != "g_idx":
        raise ModelLoadError(f"{name} appears twice in the checkpoint")
    plain = default_g_idx(in_features, quant.group_size)
    if g_idx.shape != plain.shape or not torch.equal(g_idx.to(torch.int64), plain):
        raise ModelLoadError(f"{name} is not the plain group order while the quantization_config has desc_act "
                             "false; set desc_act true in it (act-order checkpoint)")
