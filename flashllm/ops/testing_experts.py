"""fused_moe's conformance input cases (ops/testing.py's make_inputs): routings of top-1 to top-8 over 4 to 64
experts, float, int8 and int4 experts, and gpt-oss's biased swigluoai experts."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import pack_int4
from flashllm.ops.testing_blocks import seeded_randn as _randn

Inputs = dict[str, Any]


class _MoECase(NamedTuple):
    """One fused_moe input case: x (tokens, hidden); E experts of `inter` features; k experts a token.

    renormalized: each token's k weights sum to one (Mixtral; Qwen2-MoE with norm_topk_prob), else
    they are its top-k softmax probabilities over all E experts, summing to less than one.
    """

    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    renormalized: bool = True
    scheme: str = "none"  # "w8a16": int8 experts, per-channel scales; "w4a16": packed int4, grouped scales
    group_size: int = -1  # w4a16: input features sharing a scale
    activation: str = "silu"  # "swigluoai": gpt-oss's clamped activation, with expert biases


# top-1, top-2, top-4 over 60 experts (Qwen1.5-MoE's routing) and top-8 (Qwen2-57B's), one decode
# token and several, renormalized and not, and every token on one expert (the load-imbalanced extreme)
MOE_CASES: dict[str, _MoECase] = {
    "spread": _MoECase(9, 64, 48, 6, 2),
    "one_token": _MoECase(1, 64, 32, 4, 2),
    "skewed": _MoECase(17, 32, 48, 8, 1),
    "top1_decode_batch": _MoECase(4, 64, 32, 8, 1),
    "top2_one_token_unnormalized": _MoECase(1, 96, 64, 8, 2, renormalized=False),
    "top4_60_experts_unnormalized": _MoECase(6, 64, 32, 60, 4, renormalized=False),
    "top8_renormalized": _MoECase(5, 64, 48, 16, 8),
    "top8_one_token_unnormalized": _MoECase(1, 64, 32, 64, 8, renormalized=False),
    # int8 experts: rows of 64 features (the cpu kernel's native int8 products) and of 48 (not)
    "w8a16_top2": _MoECase(9, 64, 64, 8, 2, scheme="w8a16"),
    "w8a16_one_token_unnormalized": _MoECase(1, 96, 48, 8, 2, renormalized=False, scheme="w8a16"),
    # int4 experts: groups of 32 over several tokens, per-channel scales for one token
    "w4a16_group32": _MoECase(7, 64, 64, 8, 2, scheme="w4a16", group_size=32),
    "w4a16_per_channel_one_token": _MoECase(1, 64, 48, 6, 3, renormalized=False, scheme="w4a16"),
    # gpt-oss: biased experts, clamped SwiGLU, top-k weights a softmax over the chosen experts
    "swigluoai_bias": _MoECase(9, 64, 48, 8, 4, activation="swigluoai"),
    "swigluoai_bias_one_token": _MoECase(1, 64, 32, 8, 4, activation="swigluoai"),
}


def _expert_codes(gen: torch.Generator, c: _MoECase, n: int, k: int, device: str) -> tuple[Tensor, Tensor]:
    """Random codes over the whole range and fp32 scales giving outputs of about unit size: w8a16 int8
    (E, N, K) and (E, N); w4a16 packed uint8 (E, N, K/2) and (E, N, G)."""
    if c.scheme == "w8a16":
        codes = torch.randint(-127, 128, (c.experts, n, k), generator=gen, dtype=torch.int8)
        scales = (torch.rand(c.experts, n, generator=gen) + 0.5) * (k**-0.5 / 64)
        return codes.to(device), scales.to(device)
    groups = 1 if c.group_size == -1 else k // c.group_size
    codes = pack_int4(torch.randint(0, 16, (c.experts, n, k), generator=gen))
    scales = (torch.rand(c.experts, n, groups, generator=gen) + 0.5) * (k**-0.5 / 4)
    return codes.to(device), scales.to(device)


def fused_moe_inputs(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    c = MOE_CASES[case]
    if case == "skewed":  # every token on one expert
        topk_ids = torch.full((c.tokens, c.top_k), 3, dtype=torch.int64)
        weights = torch.softmax(torch.randn(c.tokens, c.top_k, generator=gen), dim=-1)
    elif case in ("spread", "one_token"):
        topk_ids = torch.stack([torch.randperm(c.experts, generator=gen)[:c.top_k] for _ in range(c.tokens)])
        weights = torch.softmax(torch.randn(c.tokens, c.top_k, generator=gen), dim=-1)
    else:  # routed as a model routes: the top-k of a softmax over every expert
        probs = torch.softmax(torch.randn(c.tokens, c.experts, generator=gen) * 2, dim=-1)
        weights, topk_ids = torch.topk(probs, c.top_k, dim=-1)
        if c.renormalized:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    inputs: Inputs = {"x": _randn(gen, c.tokens, c.hidden, dtype=dtype, device=device),
                      "topk_weights": weights.to(device), "topk_ids": topk_ids.to(device)}
    if c.scheme != "none":
        inputs["w13"], inputs["w13_scale"] = _expert_codes(gen, c, 2 * c.inter, c.hidden, device)
        inputs["w2"], inputs["w2_scale"] = _expert_codes(gen, c, c.hidden, c.inter, device)
        return inputs
    inputs["w13"] = _randn(gen, c.experts, 2 * c.inter, c.hidden, dtype=dtype, device=device, std=c.hidden**-0.5)
    inputs["w2"] = _randn(gen, c.experts, c.hidden, c.inter, dtype=dtype, device=device, std=c.inter**-0.5)
    if c.activation != "silu":  # gate features past the clamp (std 6 around +-7) bend the activation; w2 brings the
        inputs["w13"] = inputs["w13"] * 6  # outputs back to about unit size, as the tolerances expect
        inputs["w2"] = inputs["w2"] / 16
        inputs["w13_bias"] = _randn(gen, c.experts, 2 * c.inter, dtype=dtype, device=device)
        inputs["w2_bias"] = _randn(gen, c.experts, c.hidden, dtype=dtype, device=device)
        inputs["activation"] = c.activation
    return inputs
