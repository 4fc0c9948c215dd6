"""fused_moe: the routed experts of a mixture-of-experts MLP (Mixtral, Qwen-MoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Not gated on the model's quant request: a kernel lists in Caps.quant the expert formats of
# EXPERT_SCHEMES it takes, and a MoE layer stores its experts in one of those (models/layers/moe.py),
# so a kernel never receives a format it did not claim.
USES: frozenset[str] = frozenset()
# "none": float w13 / w2; "w8a16": int8 codes with a float scale per expert and output channel
EXPERT_SCHEMES: frozenset[str] = frozenset({"none", "w8a16"})


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_scale: Tensor | None = None, w2_scale: Tensor | None = None) -> Tensor:
    """Weighted sum of each token's top-k experts' gated MLP outputs.

    Shapes: x (T, H); w13 (E, 2I, H), each expert's gate rows then up rows; w2 (E, H, I);
    topk_weights (T, k) float routing weights (already normalized as the model wants);
    topk_ids (T, k) int64 expert ids in [0, E).
    out[t] = sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e].T, with e = topk_ids[t, j] and
    (g | u) = x[t] @ w13[e].T.
    Weights: float, with both scales None; or "w8a16": int8 codes with float w13_scale (E, 2I) and
    w2_scale (E, H), the weight being codes[e, n, :] * scale[e, n] (symmetric, per expert and output
    channel).
    Numerics: both matmuls, the activation and the weighted sum run in fp32; returns (T, H) in
    x.dtype. Kernels that round the intermediate to x.dtype stay within tolerances.
    """
    num_experts = w13.shape[0]
    check_expert_scales(w13, w2, w13_scale, w2_scale)
    if topk_ids.numel() and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < num_experts:
        raise ValueError(
            f"fused_moe: topk_ids range [{int(topk_ids.min())}, {int(topk_ids.max())}] is outside "
            f"[0, {num_experts}) for {num_experts} experts"
        )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(num_experts):
        token_idx, slot_idx = (topk_ids == expert).nonzero(as_tuple=True)
        if token_idx.numel() == 0:
            continue
        gate_up = x[token_idx].float() @ expert_weight(w13, w13_scale, expert).T  # (n, 2I)
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = (F.silu(gate) * up) @ expert_weight(w2, w2_scale, expert).T  # (n, H)
        weights = topk_weights[token_idx, slot_idx].float()[:, None]
        out.index_add_(0, token_idx, expert_out * weights)
    return out.to(x.dtype)


def expert_weight(weight: Tensor, scale: Tensor | None, expert: int) -> Tensor:
    """Expert `expert`'s (N, K) weight in fp32: dequantized codes * scale when `scale` is given."""
    if scale is None:
        return weight[expert].float()
    return weight[expert].float() * scale[expert].float()[:, None]


def check_expert_scales(w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None) -> None:
    """Raise ValueError unless the weights are float without scales, or int8 with (E, N) float scales."""
    if w13_scale is None and w2_scale is None:
        if not (w13.is_floating_point() and w2.is_floating_point()):
            raise ValueError(f"fused_moe: {w13.dtype} / {w2.dtype} experts need w13_scale and w2_scale")
        return
    for name, weight, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if weight.dtype != torch.int8 or scale is None or tuple(scale.shape) != tuple(weight.shape[:2]) \
                or not scale.is_floating_point():
            raise ValueError(
                f"fused_moe: w8a16 experts need int8 {name} with float {name}_scale of shape "
                f"{tuple(weight.shape[:2])}; got {weight.dtype} and "
                f"{None if scale is None else (scale.dtype, tuple(scale.shape))}"
            )
