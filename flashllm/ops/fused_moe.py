"""fused_moe: the routed experts of a mixture-of-experts MLP (Mixtral, Qwen-MoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Experts take float w13/w2: weight-only schemes quantize the linear layers, not the experts,
# so fused_moe is not gated on "quant" until its weights become QuantizedWeight.
USES: frozenset[str] = frozenset()


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Weighted sum of each token's top-k experts' gated MLP outputs.

    Shapes: x (T, H); w13 (E, 2I, H), each expert's gate rows then up rows; w2 (E, H, I);
    topk_weights (T, k) float routing weights (already normalized as the model wants);
    topk_ids (T, k) int64 expert ids in [0, E).
    out[t] = sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e].T, with e = topk_ids[t, j] and
    (g | u) = x[t] @ w13[e].T.
    Numerics: both matmuls, the activation and the weighted sum run in fp32; returns (T, H) in
    x.dtype. Kernels that round the intermediate to x.dtype stay within tolerances.
    """
    num_experts = w13.shape[0]
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
        gate_up = x[token_idx].float() @ w13[expert].float().T  # (n, 2I)
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = (F.silu(gate) * up) @ w2[expert].float().T  # (n, H)
        weights = topk_weights[token_idx, slot_idx].float()[:, None]
        out.index_add_(0, token_idx, expert_out * weights)
    return out.to(x.dtype)
