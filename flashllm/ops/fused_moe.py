"""fused_moe: the routed experts of a mixture-of-experts MLP (Mixtral, Qwen-MoE, gpt-oss)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.ops.quant_matmul import QuantizedWeight, dequantize

# Not gated on the model's quant request: a kernel lists in Caps.quant the expert formats of
# EXPERT_SCHEMES it takes, and a MoE layer stores its experts in one of those (models/layers/moe.py),
# so a kernel never receives a format it did not claim.
USES: frozenset[str] = frozenset({"moe_activation"})
# "none": float w13 / w2; "w8a16": int8 codes with a float scale per expert and output channel;
# "w4a16": symmetric int4 codes packed two per byte with a float scale per expert, output channel and group
EXPERT_SCHEMES: frozenset[str] = frozenset({"none", "w8a16", "w4a16"})
# The experts' activations: "silu" is silu(g) * u; "swigluoai" is gpt-oss's clamped form (expert_activation)
MOE_ACTIVATIONS: frozenset[str] = frozenset({"silu", "swigluoai"})
# gpt-oss's swiglu_alpha and swiglu_limit (its config's defaults; other values are refused at load)
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_scale: Tensor | None = None, w2_scale: Tensor | None = None, w13_bias: Tensor | None = None,
              w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    """Weighted sum of each token's top-k experts' gated MLP outputs.

    Shapes: x (T, H); w13 (E, 2I, H), each expert's gate rows then up rows; w2 (E, H, I);
    topk_weights (T, k) float routing weights (already normalized as the model wants);
    topk_ids (T, k) int64 expert ids in [0, E).
    out[t] = sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e].T, with e = topk_ids[t, j] and
    (g | u) = x[t] @ w13[e].T.
    Weights: float, with both scales None; or "w8a16": int8 codes with float w13_scale (E, 2I) and
    w2_scale (E, H), the weight being codes[e, n, :] * scale[e, n] (symmetric, per expert and output
    channel); or "w4a16": uint8 w13 (E, 2I, H/2) and w2 (E, H, I/2) holding two int4 codes a byte as
    QuantizedWeight's w4a16 (low nibble first, 0..15 around the zero point 8), float w13_scale
    (E, 2I, G13) and w2_scale (E, H, G2), G groups of K / G input features each.
    Biases (gpt-oss): w13_bias (E, 2I) is added to x[t] @ w13[e].T and w2_bias (E, H) to the expert's output
    before it is weighted. activation "swigluoai" replaces silu(g) * u by gpt-oss's clamped form
    (expert_activation); a kernel runs it, and biases, only where its Caps.moe_activations claim it.
    Numerics: both matmuls, the activation and the weighted sum run in fp32; returns (T, H) in
    x.dtype. Kernels that round the intermediate to x.dtype stay within tolerances.
    """
    num_experts = w13.shape[0]
    check_expert_scales(w13, w2, w13_scale, w2_scale)
    check_expert_biases(w13, w2, w13_bias, w2_bias, activation)
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
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        expert_out = expert_activation(gate_up, activation) @ expert_weight(w2, w2_scale, expert).T  # (n, H)
        if w2_bias is not None:
            expert_out = expert_out + w2_bias[expert].float()
        weights = topk_weights[token_idx, slot_idx].float()[:, None]
        out.index_add_(0, token_idx, expert_out * weights)
    return out.to(x.dtype)


def expert_activation(gate_up: Tensor, activation: str = "silu") -> Tensor:
    """An expert's gate then up features (n, 2I) fp32 -> (n, I) fp32: silu(g) * u, or for "swigluoai"
    (gpt-oss) (u' + 1) * g' * sigmoid(1.702 g') with g' = min(g, 7) and u' = clamp(u, -7, 7)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA)


def check_expert_biases(w13: Tensor, w2: Tensor, w13_bias: Tensor | None, w2_bias: Tensor | None,
                        activation: str) -> None:
    """Raise ValueError for an activation outside MOE_ACTIVATIONS or a bias that is not float (E, 2I) / (E, H)."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {sorted(MOE_ACTIVATIONS)}")
    experts, hidden = w2.shape[0], w2.shape[1]
    for name, bias, shape in (("w13_bias", w13_bias, (experts, w13.shape[1])), ("w2_bias", w2_bias, (experts, hidden))):
        if bias is not None and (not bias.is_floating_point() or tuple(bias.shape) != shape):
            raise ValueError(f"fused_moe: {name} must be float of shape {shape}, got {bias.dtype} {tuple(bias.shape)}")


def expert_batches(topk_ids: Tensor, topk_weights: Tensor,
                   num_experts: int) -> Iterator[tuple[int, Tensor | None, Tensor]]:
    """A routing's (token, slot) pairs grouped by expert, as a per-expert loop over chosen experts takes them:
    (expert, token rows, their fp32 weights (n, 1)), ascending experts, sorted with one host sync; for a
    single token its k experts in slot order, with rows None (the whole of x) and a 0-d weight. Unchosen
    experts never appear. Raises ValueError for ids outside [0, num_experts)."""
    if topk_ids.numel() == 0:
        return
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    low, high = (int(v) for v in torch.aminmax(flat))
    if low < 0 or high >= num_experts:
        raise ValueError(f"fused_moe: topk_ids range [{low}, {high}] is outside [0, {num_experts}) "
                         f"for {num_experts} experts")
    weights = topk_weights.float()
    if num_tokens == 1:  # one decode token: its k experts in turn, nothing to sort or scatter
        for slot, expert in enumerate(topk_ids[0].tolist()):
            yield expert, None, weights[0, slot]
        return
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k  # the token of each (token, slot) pair, sorted by expert
    pair_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            yield expert, tokens[start:start + count], pair_weights[start:start + count, None]
            start += count


def expert_weight(weight: Tensor, scale: Tensor | None, expert: int) -> Tensor:
    """Expert `expert`'s (N, K) weight in fp32: dequantized codes * scale when `scale` is given."""
    if scale is None:
        return weight[expert].float()
    if weight.dtype == torch.uint8:
        return dequantize(expert_int4(weight, scale, expert))
    return weight[expert].float() * scale[expert].float()[:, None]


def expert_int4(weight: Tensor, scale: Tensor, expert: int) -> QuantizedWeight:
    """Expert `expert` of w4a16 experts as the QuantizedWeight quant_matmul multiplies by."""
    in_features, groups = 2 * weight.shape[-1], scale.shape[-1]
    return QuantizedWeight("w4a16", weight[expert], scale[expert], None, -1 if groups == 1 else in_features // groups)


def check_expert_scales(w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None) -> None:
    """Raise ValueError unless the weights are float without scales, int8 with (E, N) float scales, or
    packed int4 (uint8) with (E, N, G) float scales, G dividing the input features."""
    if w13_scale is None and w2_scale is None:
        if not (w13.is_floating_point() and w2.is_floating_point()):
            raise ValueError(f"fused_moe: {w13.dtype} / {w2.dtype} experts need w13_scale and w2_scale")
        return
    for name, weight, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        int4 = weight.dtype == torch.uint8
        ok = scale is not None and scale.is_floating_point() and weight.dtype in (torch.int8, torch.uint8)
        if ok and int4:
            ok = scale.dim() == 3 and scale.shape[:2] == weight.shape[:2] and (2 * weight.shape[2]) % scale.shape[2] == 0
        elif ok:
            ok = tuple(scale.shape) == tuple(weight.shape[:2])
        if not ok:
            raise ValueError(
                f"fused_moe: quantized experts need int8 {name} with a float {name}_scale of shape (E, N) "
                f"(w8a16), or packed uint8 {name} with (E, N, G) (w4a16); got {weight.dtype} {tuple(weight.shape)} and "
                f"{None if scale is None else (scale.dtype, tuple(scale.shape))}"
            )
