"""AWQ (Lin et al. 2023): per-input-channel scales from activation magnitude, searched on the layer's output error."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashllm.ptq.calibration import CalibrationStats, LinearGroup
from flashllm.quant.gptq import IntegerWeight
from flashllm.quant.gptq_solver import rtn_quantize

DEFAULT_GRID = 20   # ratios 0, 1/20, ..., 19/20, the paper's search grid
_MIN_FACTOR = 1e-4  # a channel that never fired still gets a finite, invertible scale


@dataclass(frozen=True, slots=True)
class AwqSearch:
    """The chosen scales s (K,) fp32, the ratio they came from, and (ratio, loss) for every ratio tried."""

    factors: Tensor
    ratio: float
    losses: tuple[tuple[float, float], ...]


def scales_for_ratio(act_mean: Tensor, ratio: float) -> Tensor:
    """s = mean|x|^ratio, normalised so that max(s) * min(s) = 1 (fp32 (K,)); ratio 0 gives s = 1."""
    s = act_mean.to(torch.float32).clamp(min=_MIN_FACTOR).pow(ratio)
    s = s / (s.max() * s.min()).sqrt()
    return s.clamp(min=_MIN_FACTOR)


def awq_quantize(weight: Tensor, factors: Tensor, bits: int = 4, group_size: int = 128) -> IntegerWeight:
    """Group-wise asymmetric RTN of W diag(s) (N, K): the weight AWQ stores; x must be divided by s."""
    return rtn_quantize(weight.to(torch.float32) * factors.to(torch.float32)[None, :], bits, group_size, sym=False)


def awq_objective(weight: Tensor, x: Tensor, factors: Tensor, bits: int = 4, group_size: int = 128,
                  reference: Tensor | None = None) -> float:
    """Mean squared error between x W^T and (x / s) Q(W diag(s))^T over calibration rows x (T, K).

    reference: x @ W.T (T, N) fp32 when the caller already has it.
    """
    x = x.to(torch.float32)
    if reference is None:
        reference = x @ weight.to(torch.float32).T
    quantized = awq_quantize(weight, factors, bits, group_size).dequantize()
    out = (x / factors.to(torch.float32)[None, :]) @ quantized.T
    return float((out - reference).pow(2).mean())


def awq_search(weight: Tensor, x: Tensor, act_mean: Tensor, bits: int = 4, group_size: int = 128,
               grid: int = DEFAULT_GRID) -> AwqSearch:
    """Grid-search ratio in [0, 1) for s = mean|x|^ratio minimising awq_objective.

    weight: float (N, K) (a fused projection's shards stacked, so they share one s);
    x: (T, K) calibration inputs of the layer; act_mean: (K,) mean |x_j| over all calibration
    tokens. Ratio 0 (s = 1, plain RTN) is always a candidate, so the result is never worse
    than no scaling on this objective.
    """
    if grid < 1:
        raise ValueError(f"grid {grid} must be >= 1 (number of ratios tried in [0, 1))")
    w = weight.detach().to(torch.float32)
    x = x.to(device=w.device, dtype=torch.float32)
    reference = x @ w.T
    losses: list[tuple[float, float]] = []
    best: tuple[float, float, Tensor] | None = None
    for step in range(grid):
        ratio = step / grid
        factors = scales_for_ratio(act_mean.to(w.device), ratio)
        loss = awq_objective(w, x, factors, bits, group_size, reference)
        losses.append((ratio, loss))
        if best is None or loss < best[1]:
            best = (ratio, loss, factors)
    assert best is not None
    return AwqSearch(best[2], best[0], tuple(losses))


def awq_tensors(tensors: dict[str, Tensor], groups: list[LinearGroup], stats: CalibrationStats, bits: int = 4,
                group_size: int = 128, grid: int = DEFAULT_GRID
                ) -> tuple[dict[str, Tensor], dict[str, IntegerWeight], dict[str, AwqSearch]]:
    """Search and apply AWQ scales layer by layer, then quantize: (new tensors, codes per module, searches).

    In module order, each layer whose input producer can absorb 1/s (an RMSNorm, or a linear
    whose output rows are exactly this input, e.g. up_proj for down_proj and v_proj for o_proj
    without GQA) gets its scales searched on the current weights and applied: its columns
    times s, the producer divided by s, so the float function is unchanged. Layers with no such
    producer keep s = 1. Every layer is then quantized group-wise asymmetric (zero point) RTN.
    The returned tensors still hold the scaled float weights; the writer replaces them.
    """
    out = dict(tensors)
    searches: dict[str, AwqSearch] = {}
    for group in groups:
        entry = stats.linears.get(group.module)
        if entry is None:
            raise ValueError(f"no calibration statistics for {group.module}; the calibration forward never reached it")
        weight = group.fused_weight(out)
        if not _can_fold(out, group, weight.shape[1]):
            continue
        search = awq_search(weight, entry.sample_rows(), entry.act_mean, bits, group_size, grid)
        searches[group.module] = search
        _apply_scales(out, group, weight, search.factors.cpu())
    codes = {group.module: rtn_quantize(group.fused_weight(out), bits, group_size, sym=False) for group in groups}
    return out, codes, searches


def _can_fold(tensors: dict[str, Tensor], group: LinearGroup, in_features: int) -> bool:
    if group.producer is None:
        return False
    _, producer = group.producer
    rows = tensors[f"{producer}.weight"].shape[0]
    return rows == in_features  # a GQA v_proj has fewer rows than o_proj has inputs


def _apply_scales(tensors: dict[str, Tensor], group: LinearGroup, weight: Tensor, factors: Tensor) -> None:
    _, producer = group.producer
    for name in (f"{producer}.weight", f"{producer}.bias"):
        if name in tensors:
            old = tensors[name]
            scaled = old.to(torch.float32) / (factors if old.dim() == 1 else factors[:, None])
            tensors[name] = scaled.to(old.dtype)
    scaled = weight * factors[None, :]
    for prefix, rows in zip(group.prefixes, scaled.split(group.shard_rows(tensors)), strict=True):
        tensors[f"{prefix}.weight"] = rows.to(tensors[f"{prefix}.weight"].dtype)
