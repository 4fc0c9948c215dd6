"""fused_moe inputs with a shared expert (Qwen2-MoE's, DeepSeek's): the op's contract takes it as extra experts.

A shared expert of width m * I is m gated MLPs of width I (silu(g) * u is elementwise over the
intermediate features and the down projection sums over them), so it enters `fused_moe` as m more
experts that every token routes to, each with the shared gate's weight sigmoid(x @ gate). No new
argument: every kernel of the op runs it. The expected output here is computed densely in float64
from the unsplit shared weights, independently of any kernel and of that rewriting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _per_channel_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> int8 codes (N, K) and fp32 scales (N,), round to nearest against max|w| / 127 per row."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 127
    return (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.float()


def add_shared_expert(inputs: dict[str, Any], parts: int, seed: int) -> tuple[dict[str, Any], Tensor]:
    """(fused_moe inputs with E + parts experts and k + parts slots a token, the expected (T, H) float64 output).

    `inputs`: fused_moe's keyword arguments with float or w8a16 experts (make_inputs). The shared expert
    is random with width parts * I, quantized per output channel when the routed experts are w8a16 (its
    down projection's scales are per row, so each of its parts keeps them whole); its gate is a random
    (H,) vector. Expected: each token's routed experts weighted as given, plus sigmoid(x @ gate) times
    the shared gated MLP, all on the weights the codes stand for.
    """
    x, w13, w2, weights, ids = (inputs[k] for k in ("x", "w13", "w2", "topk_weights", "topk_ids"))
    s13, s2 = inputs.get("w13_scale"), inputs.get("w2_scale")
    if s13 is not None and w13.dtype != torch.int8:
        raise ValueError(f"add_shared_expert takes float or int8 (w8a16) experts, not {w13.dtype}")
    num_experts, hidden, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    width, device = parts * inter, x.device
    gen = torch.Generator().manual_seed(seed)
    gate_rows, up_rows = (torch.randn(width, hidden, generator=gen) * hidden**-0.5 for _ in range(2))
    down = torch.randn(hidden, width, generator=gen) * width**-0.5
    gate_vec = torch.randn(hidden, generator=gen) * 2 * hidden**-0.5

    def expert_rows(e: int, name: str) -> Tensor:  # a routed expert's weight, float64
        w, s = (w13, s13) if name == "w13" else (w2, s2)
        return w[e].double().cpu() * (1.0 if s is None else s[e].double().cpu()[:, None])

    if s13 is not None:  # the shared expert as int8 too: its parts carry their rows' codes and scales
        (g_codes, g_scale), (u_codes, u_scale), (d_codes, d_scale) = map(_per_channel_int8, (gate_rows, up_rows, down))
        gate_rows, up_rows = g_codes.double() * g_scale.double()[:, None], u_codes.double() * u_scale.double()[:, None]
        down = d_codes.double() * d_scale.double()[:, None]
        part = [slice(j * inter, (j + 1) * inter) for j in range(parts)]
        new13 = torch.stack([torch.cat([g_codes[p], u_codes[p]]) for p in part])
        new13_scale = torch.stack([torch.cat([g_scale[p], u_scale[p]]) for p in part])
        new2 = torch.stack([d_codes[:, p] for p in part])
        new2_scale = d_scale.expand(parts, hidden)
    else:
        part = [slice(j * inter, (j + 1) * inter) for j in range(parts)]
        new13 = torch.stack([torch.cat([gate_rows[p], up_rows[p]]) for p in part]).to(w13.dtype)
        new2 = torch.stack([down[:, p] for p in part]).to(w2.dtype)
        gate_rows, up_rows, down = (w.to(w13.dtype).double() for w in (gate_rows, up_rows, down))

    xd = x.double().cpu()
    shared_weight = torch.sigmoid(xd @ gate_vec.double())  # (T,)
    expected = shared_weight[:, None] * ((F.silu(xd @ gate_rows.T) * (xd @ up_rows.T)) @ down.T)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (xd[t] @ expert_rows(e, "w13").T).chunk(2)
            expected[t] += float(weights[t, j]) * ((F.silu(g) * u) @ expert_rows(e, "w2").T)

    out = dict(inputs)
    out["w13"] = torch.cat([w13, new13.to(device)])
    out["w2"] = torch.cat([w2, new2.to(device)])
    if s13 is not None:
        out["w13_scale"] = torch.cat([s13, new13_scale.to(s13.dtype).to(device)])
        out["w2_scale"] = torch.cat([s2, new2_scale.to(s2.dtype).to(device)])
    shared_ids = torch.arange(num_experts, num_experts + parts, device=device).expand(ids.shape[0], parts)
    out["topk_ids"] = torch.cat([ids, shared_ids.to(ids.dtype)], dim=1)
    shared_slots = shared_weight.to(weights.dtype).to(device)[:, None].expand(ids.shape[0], parts)
    out["topk_weights"] = torch.cat([weights, shared_slots], dim=1)
    return out, expected
