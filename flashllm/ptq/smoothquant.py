"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights, then int8 per-channel weights."""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ptq.calibration import CalibrationStats, LinearGroup
from flashllm.quant.spec import SMOOTH_FACTOR_SUFFIX, WEIGHT_SCALE_SUFFIX
from flashllm.quant.weight_only import quantize_weight

DEFAULT_ALPHA = 0.5
# factors are clamped to this floor so a channel that never fired (max|x| = 0) keeps a finite 1/s
_MIN_FACTOR = 1e-5


def smooth_factors(act_absmax: Tensor, weight: Tensor, alpha: float = DEFAULT_ALPHA) -> Tensor:
    """Per-input-channel factors s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), fp32 (K,).

    act_absmax: (K,) max |x_j| over the calibration tokens; weight: float (N, K), the max over
    its output rows (for a fused projection, over every shard, since they share x). Dividing x
    by s and multiplying W's columns by s leaves x @ W.T unchanged; alpha = 0.5 splits the
    quantization difficulty evenly. Channels with no activation or no weight keep s = 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha {alpha} must be in [0, 1] (0.5 is the paper's default; larger moves more into W)")
    x_max = act_absmax.to(torch.float32)
    w_max = weight.detach().to(torch.float32).abs().amax(dim=0)
    if x_max.shape != w_max.shape:
        raise ValueError(f"act_absmax has {x_max.numel()} channels but the weight has {w_max.numel()} inputs")
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    usable = (x_max > 0) & (w_max > 0) & torch.isfinite(s)
    return torch.where(usable, s.clamp(min=_MIN_FACTOR), torch.ones_like(s))


def smooth_weight(weight: Tensor, factors: Tensor) -> Tensor:
    """W diag(s): (N, K) float -> fp32 (N, K), column j multiplied by s_j."""
    return weight.to(torch.float32) * factors.to(torch.float32)[None, :]


def fold_into_norm(norm_weight: Tensor, factors: Tensor) -> Tensor:
    """RMSNorm scale gamma / s: (K,) -> (K,) fp32, so the norm's output is already x / s."""
    return norm_weight.to(torch.float32) / factors.to(torch.float32)


def quantize_int8_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: float (N, K) -> (codes int8 (N, K) in -127..127, scale fp32 (N, 1)).

    The grid of flashllm.quant.quantize_weight's w8a16: scale = max|w_n| / 127.
    """
    quantized = quantize_weight(weight, "w8a16", -1, True)
    return quantized.data, quantized.scales.to(torch.float32)


def smoothquant_tensors(tensors: dict[str, Tensor], groups: list[LinearGroup], stats: CalibrationStats,
                        alpha: float = DEFAULT_ALPHA, quantize: bool = True) -> dict[str, Tensor]:
    """Smooth every linear layer of a checkpoint and (when `quantize`) store int8 codes; a new tensor dict.

    A layer fed by an RMSNorm (qkv, gate_up) gets 1/s folded into the norm's scale; any other
    keeps `<prefix>.smooth_factor` (K,) fp32 for the op to divide x by. Quantized layers store
    `<prefix>.weight` int8 (N, K) and `<prefix>.weight_scale` fp32 (N, 1) (quant/spec.py's
    layout); quantize=False stores the smoothed float weight instead, which computes the same
    function as the original model (up to rounding), the property a test checks.
    """
    out = dict(tensors)
    folded: set[str] = set()
    for group in groups:
        entry = stats.linears.get(group.module)
        if entry is None:
            raise ValueError(f"no calibration statistics for {group.module}; the calibration forward never reached it")
        weight = group.fused_weight(tensors)
        factors = smooth_factors(entry.act_absmax.cpu(), weight, alpha)
        kind, producer = group.producer or ("", "")
        if kind == "norm":
            if producer in folded:
                raise ValueError(f"{producer} feeds more than one smoothed layer; one norm can absorb only one s")
            folded.add(producer)
            norm = out[f"{producer}.weight"]
            out[f"{producer}.weight"] = fold_into_norm(norm, factors).to(norm.dtype)
        smoothed = smooth_weight(weight, factors)
        for prefix, rows in zip(group.prefixes, smoothed.split(group.shard_rows(tensors)), strict=True):
            out.update(_layer_tensors(prefix, rows, tensors[f"{prefix}.weight"].dtype, quantize))
            if kind != "norm":
                out[f"{prefix}.{SMOOTH_FACTOR_SUFFIX}"] = factors.clone()
    return out


def _layer_tensors(prefix: str, smoothed: Tensor, dtype: torch.dtype, quantize: bool) -> dict[str, Tensor]:
    if not quantize:
        return {f"{prefix}.weight": smoothed.to(dtype)}
    codes, scale = quantize_int8_per_channel(smoothed)
    return {f"{prefix}.weight": codes.contiguous(), f"{prefix}.{WEIGHT_SCALE_SUFFIX}": scale.contiguous()}
