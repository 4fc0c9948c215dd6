"""Gated DeltaNet (Qwen3-Next's linear attention): a causal short convolution over q, k, v, then the gated delta
rule, a per-head (k_dim, v_dim) fast-weight state decayed by exp(g) and corrected toward each token's value, read by
the queries; the output RMS-normed and gated by silu(z). The state is kept per sequence (models/layers/recurrent.py).

Shapes below: T tokens of a flat batch, n sequences, L tokens of one sequence, H value heads on this rank, Dk / Dv
the key / value head dims. The recurrence runs in float32 whatever the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from flashllm.models.layers.recurrent import (
    StateSpans,
    causal_conv1d,
    channel_param,
    read_states,
    sequence_state,
    sharded_param,
    store_sequence_state,
    write_states,
)

# prefill chunk of the parallel (chunked) form; shorter sequences take one chunk
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True, slots=True)
class RecurrentCache:
    """What one Gated DeltaNet layer reads and writes in a pass: its state tensors and the batch's spans.

    conv_state (num_slots, C, K - 1) in the model dtype; recurrent_state (num_slots, H, Dk, Dv) float32."""

    conv_state: Tensor
    recurrent_state: Tensor
    spans: StateSpans


def l2_normalized(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's form, which transformers follows)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token: for each t, S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T;
    o_t = S^T q_t.

    q, k (n, L, H, Dk); v (n, L, H, Dv); g, beta (n, L, H); state (n, H, Dk, Dv); all float32, q and k already
    normalized and q scaled. Returns (outputs (n, L, H, Dv), final state (n, H, Dk, Dv))."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("nhk,nhkv->nhv", k[:, t], state)
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("nhk,nhkv->nhv", q[:, t], state)
    return out, state


def chunked_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                             chunk: int = DELTA_RULE_CHUNK) -> tuple[Tensor, Tensor]:
    """recurrent_gated_delta_rule for one sequence, a chunk of tokens at a time in matrix form.

    Within a chunk, with G_t the cumulative log decay from its start and S0 the state before it, each token's
    correction u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{s<t} e^{G_t - G_s} (k_t . k_s) u_s) is a unit lower
    triangular system in the u's; then o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s and the
    state after the chunk is e^{G_last} S0 + sum_s e^{G_last - G_s} k_s u_s^T.

    q, k (L, H, Dk); v (L, H, Dv); g, beta (L, H); state (H, Dk, Dv); float32 as the recurrent form's.
    Returns (outputs (L, H, Dv), final state (H, Dk, Dv))."""
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))  # heads first: (H, L, ...)
    outputs = []
    for lo in range(0, q.shape[1], chunk):
        qc, kc, vc, bc = q[:, lo:lo + chunk], k[:, lo:lo + chunk], v[:, lo:lo + chunk], beta[:, lo:lo + chunk]
        cum = g[:, lo:lo + chunk].cumsum(-1)  # (H, C)
        size = cum.shape[1]
        gap = cum[:, :, None] - cum[:, None, :]  # (H, C, C): G_t - G_s
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        decay = gap.masked_fill(~causal, float("-inf")).exp()  # zero above the diagonal (masked before exp)
        system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(size, dtype=q.dtype, device=q.device)
        rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))  # (H, C, Dv)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outputs.append(cum.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        last = cum[:, -1:]  # (H, 1)
        state = last.exp()[..., None] * state + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return torch.cat(outputs, dim=1).transpose(0, 1), state


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's Dv features, then times silu(z): transformers' Qwen3NextRMSNormGated (the
    normalization in float32, the scale applied in the model dtype, the gate in float32)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        """x, z (N, Dv) in the model dtype -> (N, Dv)."""
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * normed) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (transformers' Qwen3NextGatedDeltaNet), its key and value heads split over the
    tensor-parallel ranks.

    Checkpoint tensors: in_proj_qkvz (rows grouped per key head: q, k, then its value heads' v and z), in_proj_ba
    (per key head: its value heads' b, then a), conv1d.weight (q | k | v channels, (C, 1, K)), dt_bias and A_log
    (per value head), norm.weight (Dv,), out_proj. Since in_proj_qkvz / in_proj_ba group rows per key head, a
    rank's heads are one contiguous row range of each; the convolution's channels are three ranges.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
                 conv_width: int, eps: float, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if num_k_heads % tp_size:
            raise ValueError(f"linear_num_key_heads={num_k_heads} does not split over {tp_size} tensor-parallel "
                             "ranks; use a tensor-parallel size that divides it")
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, num_v_heads // num_k_heads  # value heads per key head
        self.num_k_heads, self.num_v_heads = num_k_heads // tp_size, num_v_heads // tp_size  # on this rank
        self.k_dim, self.v_dim, self.conv_width = k_dim, v_dim, conv_width
        per_k_head = 2 * k_dim + 2 * self.group * v_dim
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, num_k_heads * per_k_head, False, ops, dtype, device,
                                                 tp_rank, tp_size)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * num_v_heads, False, ops, dtype, device,
                                               tp_rank, tp_size)
        self.conv_channels = 2 * self.num_k_heads * k_dim + self.num_v_heads * v_dim
        self.conv_weight = sharded_param((self.conv_channels, conv_width), dtype, device, self._load_conv)
        self.dt_bias = channel_param((self.num_v_heads,), dtype, device, tp_rank, tp_size)
        self.A_log = channel_param((self.num_v_heads,), dtype, device, tp_rank, tp_size)
        self.norm = GatedRMSNorm(v_dim, eps, dtype, device)
        self.out_proj = RowParallelLinear(num_v_heads * v_dim, hidden_size, False, ops, dtype, device,
                                          tp_rank, tp_size)

    def _load_conv(self, param: Tensor, loaded: Tensor, shard_id: Any = None) -> None:
        """This rank's q, k and v channels of the checkpoint's (C, 1, K) depthwise filters."""
        keys, values = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        expected = ((2 * keys + values) * self.tp_size, 1, self.conv_width)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"conv1d.weight has shape {tuple(loaded.shape)} but the model expects {expected}; "
                             "the checkpoint does not match its config.json")
        weight = materialize(loaded)[:, 0]
        total_keys = keys * self.tp_size
        starts = (self.tp_rank * keys, total_keys + self.tp_rank * keys, 2 * total_keys + self.tp_rank * values)
        pieces = [weight[s:s + n] for s, n in zip(starts, (keys, keys, values), strict=True)]
        default_weight_loader(param, torch.cat(pieces), shard_id)

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(conv state (C, K - 1) in the model dtype, recurrent state (H, Dk, Dv) float32) of one sequence."""
        return (((self.conv_channels, self.conv_width - 1), self.conv_weight.dtype),
                ((self.num_v_heads, self.k_dim, self.v_dim), torch.float32))

    def forward(self, hidden: Tensor, cache: RecurrentCache) -> Tensor:
        """hidden (T, hidden) -> (T, hidden); reads and writes each sequence's states in `cache`."""
        tokens, keys = hidden.shape[0], self.num_k_heads
        qkvz = self.in_proj_qkvz(hidden).view(tokens, keys, -1)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, self.group * self.v_dim, self.group * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).view(tokens, keys, -1).split([self.group, self.group], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        mixed = causal_conv1d(mixed, self.conv_weight, None, cache.conv_state, cache.spans, "silu")
        q, k, v = mixed.split([keys * self.k_dim, keys * self.k_dim, self.num_v_heads * self.v_dim], dim=-1)
        beta = b.reshape(tokens, -1).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, -1).float() + self.dt_bias)  # (T, H)
        # float32, l2-normalized q and k, q scaled by Dk^-0.5; each key head serves `group` consecutive value heads
        q, k = (l2_normalized(x.reshape(tokens, keys, self.k_dim).float()).repeat_interleave(self.group, dim=1)
                for x in (q, k))
        q = q * self.k_dim**-0.5
        out = self._delta_rule(q, k, v.reshape(tokens, -1, self.v_dim).float(), g, beta.float(), cache)
        out = self.norm(out.to(hidden.dtype).reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(out.view(tokens, -1))

    def _delta_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cache: RecurrentCache) -> Tensor:
        """Each sequence's outputs (T, H, Dv) float32 from its carried state; rows past the last sequence zero."""
        spans, states, shape = cache.spans, cache.recurrent_state, (self.num_v_heads, self.k_dim, self.v_dim)
        out = torch.zeros_like(v)
        if not len(spans):
            return out
        if spans.decode_only:  # one token each: the recurrent step, vectorized over the sequences
            rows = spans.rows
            start = read_states(states, spans, shape, torch.float32, v.device)
            y, final = recurrent_gated_delta_rule(*(x.index_select(0, rows).unsqueeze(1) for x in (q, k, v, g, beta)),
                                                  start)
            out.index_copy_(0, rows, y[:, 0])
            write_states(states, spans, final)
            return out
        for i, (lo, hi) in enumerate(zip(spans.starts, spans.ends, strict=True)):
            start = sequence_state(states, spans, i, shape, torch.float32, v.device)
            out[lo:hi], final = chunked_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], start)
            store_sequence_state(states, spans, i, final)
        return out
