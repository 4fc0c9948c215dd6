"""Mamba's selective state-space mixer (first generation) over a flat batch, with per-sequence conv and SSM states.

The mixer is transformers' MambaMixer (its torch path): in_proj -> [x | z]; a depthwise causal convolution over x
with SiLU; x_proj -> (dt, B, C) (dt time_step_rank wide, B and C d_state wide); dt_proj and softplus; the selective
scan h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t + D x_t with A = -exp(A_log) per (channel, state);
y * silu(z); out_proj. FalconMamba normalizes dt, B and C by weightless RMS norms after x_proj, Jamba by learned ones.

Tensor parallelism splits the intermediate channels over the ranks: in_proj's x and z rows, the convolution, dt_proj's
rows, A_log, D, and out_proj's input (all-reduced). x_proj reads every channel and feeds (dt, B, C) to every channel,
so it is row-parallel: its partial products are all-reduced and each rank holds the whole (dt, B, C).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.chatglm import FusedGateUpLinear
from flashllm.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.recurrent import (
    StateSpans,
    causal_conv1d,
    channel_param,
    read_states,
    sequence_state,
    store_sequence_state,
    write_states,
)

# a prefill scan forms its tokens' decays and inputs, (tokens, channels, d_state) float32 each, this many at a time
SCAN_BLOCK = 64


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ssm_state: Tensor | None,
                   spans: StateSpans) -> Tensor:
    """y_t = C_t . h_t over each sequence of a flat batch, h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t from its carried h.

    x, dt (T, I) float32 (dt after softplus); A (I, N) float32 (negative); B, C (T, N) float32; ssm_state
    (num_slots, I, N) float32 or None, updated in place with each sequence's last h. Returns (T, I) float32, rows
    outside the spans zero (the D skip is the caller's).
    """
    y = x.new_zeros(x.shape)
    if not len(spans):
        return y
    channels, width = A.shape
    if spans.decode_only:  # one token each: one step of every sequence at once
        rows = spans.rows
        h = read_states(ssm_state, spans, (channels, width), torch.float32, x.device)  # (n, I, N)
        step_dt, step_x = dt.index_select(0, rows), x.index_select(0, rows)
        h = torch.exp(step_dt[..., None] * A) * h + (step_dt * step_x)[..., None] * B.index_select(0, rows)[:, None]
        y.index_copy_(0, rows, torch.einsum("bin,bn->bi", h, C.index_select(0, rows)))
        write_states(ssm_state, spans, h)
        return y
    # a prefill chunk, token by token: on the CPU this beats forming the (L, L, I, N) decay pairs of a blockwise
    # parallel form (a device kernel belongs in an op); decays and inputs are formed SCAN_BLOCK tokens at a time
    for i, (start, end) in enumerate(zip(spans.starts, spans.ends, strict=True)):
        h = sequence_state(ssm_state, spans, i, (channels, width), torch.float32, x.device)
        for lo in range(start, end, SCAN_BLOCK):
            hi = min(lo + SCAN_BLOCK, end)
            decays = torch.exp(dt[lo:hi, :, None] * A)  # (L, I, N)
            inputs = (dt[lo:hi] * x[lo:hi])[..., None] * B[lo:hi, None]  # (L, I, N)
            for t in range(hi - lo):
                h = decays[t] * h + inputs[t]
                y[lo + t] = h @ C[lo + t]
        store_sequence_state(ssm_state, spans, i, h)
    return y


def _inner_norm(size: int, eps: float, learned: bool, ops: Any, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    """An RMS norm of dt, B or C: Jamba's with a learned scale, FalconMamba's without (a unit scale no checkpoint
    holds, exact in the op)."""
    norm = RMSNorm(size, eps, ops, dtype, device)
    if not learned:
        del norm.weight
        norm.register_buffer("weight", torch.ones(size, dtype=dtype, device=device), persistent=False)
    return norm


class MambaMixer(nn.Module):
    """One Mamba mixer (module docstring) over this rank's share of the intermediate channels.

    hidden_size, intermediate_size, state_size (d_state), conv_kernel, time_step_rank: the sizes; use_bias: in_proj
    and out_proj biased; use_conv_bias: the convolution biased. inner_norm: None, "weightless" (FalconMamba) or
    "learned" (Jamba), the RMS norms of dt, B and C with eps `norm_eps`. Checkpoint names are transformers': in_proj,
    conv1d (weight (I, 1, K)), x_proj, dt_proj, A_log, D, out_proj[, dt_layernorm, b_layernorm, c_layernorm].
    """

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 time_step_rank: int, use_bias: bool, use_conv_bias: bool, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1, inner_norm: str | None = None,
                 norm_eps: float = 1e-6) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"Mamba's intermediate size {intermediate_size} does not split over {tp_size} "
                             "tensor-parallel ranks; pick a tensor_parallel_size that divides it")
        channels = intermediate_size // tp_size
        self.channels, self.state_size, self.time_step_rank = channels, state_size, time_step_rank
        self.conv_kernel = conv_kernel
        self.in_proj = FusedGateUpLinear(hidden_size, [intermediate_size, intermediate_size], use_bias, ops, dtype,
                                         device, tp_rank, tp_size)
        self.conv1d = nn.Module()
        self.conv1d.weight = channel_param((channels, 1, conv_kernel), dtype, device, tp_rank, tp_size)
        self.conv1d.bias = channel_param((channels,), dtype, device, tp_rank, tp_size) if use_conv_bias else None
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + 2 * state_size, False, ops, dtype, device,
                                        tp_rank, tp_size)
        self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate_size, True, ops, dtype, device,
                                            tp_rank, tp_size)
        self.A_log = channel_param((channels, state_size), dtype, device, tp_rank, tp_size)
        self.D = channel_param((channels,), dtype, device, tp_rank, tp_size)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, use_bias, ops, dtype, device,
                                          tp_rank, tp_size)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if inner_norm is not None:
            learned = inner_norm == "learned"
            self.dt_layernorm = _inner_norm(time_step_rank, norm_eps, learned, ops, dtype, device)
            self.b_layernorm = _inner_norm(state_size, norm_eps, learned, ops, dtype, device)
            self.c_layernorm = _inner_norm(state_size, norm_eps, learned, ops, dtype, device)

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(conv state (channels, K - 1) in the model dtype, SSM state (channels, d_state) float32) of one sequence."""
        dtype = self.D.dtype
        return ((self.channels, self.conv_kernel - 1), dtype), ((self.channels, self.state_size), torch.float32)

    def forward(self, hidden: Tensor, state: tuple[Tensor, ...], spans: StateSpans) -> Tensor:
        """hidden (T, hidden) in the model dtype -> (T, hidden); state: this layer's (conv_state (slots, I, K - 1),
        ssm_state (slots, I, N)), read where a sequence continues and written with its state after the pass."""
        conv_state, ssm_state = state
        x, z = self.in_proj(hidden).split(self.channels, dim=-1)  # (T, I) each
        x = causal_conv1d(x, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state, spans, "silu")
        dt, B, C = self.x_proj(x).split([self.time_step_rank, self.state_size, self.state_size], dim=-1)
        if self.dt_layernorm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.softplus(self.dt_proj(dt).float())  # (T, I), dt_proj's bias inside
        A = -torch.exp(self.A_log.float())
        x32 = x.float()
        y = selective_scan(x32, dt, A, B.float(), C.float(), ssm_state, spans) + x32 * self.D.float()
        return self.out_proj((y * F.silu(z.float())).to(hidden.dtype))
