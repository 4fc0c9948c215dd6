"""The Mamba-2 mixer (state space duality, SSD), as transformers' Mamba2Mixer / BambaMixer compute it on CPU.

in_proj -> [gate z | x B C | dt]; a causal depthwise convolution with silu over xBC (recurrent.causal_conv1d, its
last K - 1 inputs kept per sequence); x split into heads, B and C into n_groups groups shared by
num_heads / n_groups heads each; dt = clamp(softplus(dt + dt_bias), time_step_limit); per head, with A = -exp(A_log),
the recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t (h of (head_dim, d_state), kept per
sequence in float32); then the gated RMSNorm of y * silu(z) over each group's channels and out_proj.
Tensor parallelism splits heads and groups over the ranks (each rank a whole number of groups, so the gated norm
stays local), out_proj is row-parallel.

A prefill chunk runs the recurrence block by block (`chunk_size` tokens): inside a block the quadratic SSD form,
across blocks the state; a decode batch takes one vectorized step. Both equal the token-by-token loop
(tests/models/test_mamba2.py). time_step_limit is applied on every path, as the mamba_ssm kernels do (transformers'
torch decode step skips it; with the default (0, inf) it changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.chatglm import FusedGateUpLinear
from flashllm.models.layers.linear import RowParallelLinear
from flashllm.models.layers.recurrent import (
    StateSpans,
    causal_conv1d,
    read_states,
    sequence_state,
    sharded_param,
    sharded_rows_loader,
    store_sequence_state,
    write_states,
)


@dataclass(frozen=True, slots=True)
class Mamba2Sizes:
    """One Mamba-2 mixer's shape and settings, whatever the config's field names.

    num_heads x head_dim = the inner width (expand x hidden_size); n_groups divides num_heads; state_size = d_state;
    conv_kernel = K; use_bias: in_proj / out_proj biases; use_conv_bias: the convolution's; norm_eps: the gated
    RMSNorm's; time_step_limit: (min, max) of dt; chunk_size: the block length of the prefill scan.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    use_bias: bool
    use_conv_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float]
    chunk_size: int

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.n_groups * self.state_size


class _Conv(nn.Module):
    """The depthwise convolution's parameters under the checkpoint's names: weight (conv_dim, 1, K), bias."""

    def __init__(self, channels: int, sizes: tuple[int, ...], kernel: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        load = sharded_rows_loader(sizes, tp_rank, tp_size)
        self.weight = sharded_param((channels, 1, kernel), dtype, device, load)
        self.bias = sharded_param((channels,), dtype, device, load) if bias else None


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated: y * silu(z), RMS-normalized over each group of `group_size` channels, times
    the (channels,) weight; computed in float32."""

    def __init__(self, channels: int, group_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 loader: Any) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = sharded_param((channels,), dtype, device, loader)
        self.weight.data.fill_(1.0)

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        """y, z (T, channels) -> (T, channels) float32."""
        gated = y.float() * F.silu(z.float())
        groups = gated.view(gated.shape[0], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.view_as(gated) * self.weight.float()


def ssd_sequence(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h: Tensor, chunk_size: int
                 ) -> tuple[Tensor, Tensor]:
    """The SSD recurrence over one sequence's tokens from state h, block by block, without the D skip.

    x (L, H, P), dt (L, H) (after softplus and clamp), a (H,) (= -exp(A_log)), b, c (L, H, N), h (H, P, N); all
    float32. Returns y (L, H, P) and the state after the last token (H, P, N).
    """
    outputs = []
    for lo in range(0, x.shape[0], chunk_size):
        xs, dts, bs, cs = (t[lo:lo + chunk_size] for t in (x, dt, b, c))
        cum = (dts * a).cumsum(0)  # (l, H): log-decay from the block's start through each token
        causal = torch.ones(len(cum), len(cum), dtype=torch.bool, device=x.device).tril()
        # decay[t, s] = exp(cum[t] - cum[s]) for s <= t, 0 above the diagonal (masked before exp: no overflow)
        decay = (cum[:, None] - cum[None]).masked_fill(~causal[..., None], float("-inf")).exp()
        xdt = xs * dts[..., None]
        scores = torch.einsum("thn,shn->tsh", cs, bs) * decay
        y = torch.einsum("tsh,shp->thp", scores, xdt) + torch.einsum("thn,hpn->thp", cs, h) * cum.exp()[..., None]
        tail = (cum[-1] - cum).exp()  # (l, H): decay from each token to the block's end
        h = h * cum[-1].exp()[:, None, None] + torch.einsum("sh,shp,shn->hpn", tail, xdt, bs)
        outputs.append(y)
    return torch.cat(outputs), h


def ssd_step(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """One token of n sequences: x (n, H, P), dt (n, H), a (H,), b, c (n, H, N), h (n, H, P, N), float32 ->
    y (n, H, P) without the D skip, and the new state."""
    h = h * (dt * a).exp()[..., None, None] + (x * dt[..., None])[..., None] * b[:, :, None]
    return torch.einsum("nhpk,nhk->nhp", h, c), h


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer on this rank's heads (module docstring). Parameters under the checkpoint's names:
    in_proj, conv1d, dt_bias, A_log, D, norm, out_proj."""

    def __init__(self, sizes: Mamba2Sizes, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        if sizes.num_heads % tp_size or sizes.n_groups % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the Mamba-2 layers' {sizes.num_heads} "
                             f"heads and {sizes.n_groups} groups; choose a size that divides both")
        self.sizes = sizes
        self.num_heads, self.n_groups = sizes.num_heads // tp_size, sizes.n_groups // tp_size
        inner, groups = sizes.inner_size, sizes.n_groups * sizes.state_size
        self.inner, self.group_rows = inner // tp_size, groups // tp_size
        self.in_proj = FusedGateUpLinear(sizes.hidden_size, [inner, inner, groups, groups, sizes.num_heads],
                                         sizes.use_bias, ops, dtype, device, tp_rank, tp_size)
        self.conv1d = _Conv(self.inner + 2 * self.group_rows, (inner, groups, groups), sizes.conv_kernel,
                            sizes.use_conv_bias, dtype, device, tp_rank, tp_size)
        per_head = sharded_rows_loader((sizes.num_heads,), tp_rank, tp_size)
        self.dt_bias = sharded_param((self.num_heads,), dtype, device, per_head)
        self.A_log = sharded_param((self.num_heads,), dtype, device, per_head)
        self.D = sharded_param((self.num_heads,), dtype, device, per_head)
        self.norm = GatedRMSNorm(self.inner, inner // sizes.n_groups, sizes.norm_eps, dtype, device,
                                 sharded_rows_loader((inner,), tp_rank, tp_size))
        self.out_proj = RowParallelLinear(inner, sizes.hidden_size, sizes.use_bias, ops, dtype, device, tp_rank,
                                          tp_size)

    def state_shapes(self, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(conv state (conv channels, K - 1) in the model dtype, SSM state (heads, head_dim, d_state) float32)."""
        return (((self.inner + 2 * self.group_rows, self.sizes.conv_kernel - 1), dtype),
                ((self.num_heads, self.sizes.head_dim, self.sizes.state_size), torch.float32))

    def forward(self, hidden: Tensor, state: tuple[Tensor, Tensor] | None, spans: StateSpans) -> Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size); state: this layer's (conv_state, ssm_state) slot tensors
        (None: start every sequence from zeros), read and written per spans."""
        conv_state, ssm_state = state if state is not None else (None, None)
        z, xbc, dt = self.in_proj(hidden).split([self.inner, self.inner + 2 * self.group_rows, self.num_heads], -1)
        xbc = causal_conv1d(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state, spans, "silu")
        x, b, c = xbc.split([self.inner, self.group_rows, self.group_rows], -1)
        y = self._scan(x, b, c, dt, ssm_state, spans)
        return self.out_proj(self.norm(y, z).to(hidden.dtype))

    def _scan(self, x: Tensor, b: Tensor, c: Tensor, dt: Tensor, ssm_state: Tensor | None, spans: StateSpans
              ) -> Tensor:
        """The SSD recurrence with the D skip over every sequence of the batch: (T, inner) float32."""
        tokens, heads, head_dim, n = x.shape[0], self.num_heads, self.sizes.head_dim, self.sizes.state_size
        per_group = heads // self.n_groups
        x = x.float().view(tokens, heads, head_dim)
        b = b.float().view(tokens, self.n_groups, n).repeat_interleave(per_group, dim=1)  # (T, H, N)
        c = c.float().view(tokens, self.n_groups, n).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.sizes.time_step_limit)
        a = -torch.exp(self.A_log.float())
        out = torch.zeros_like(x)
        shape = (heads, head_dim, n)
        if len(spans) and spans.decode_only:
            rows = spans.rows
            h = read_states(ssm_state, spans, shape, torch.float32, x.device)
            y, h = ssd_step(x[rows], dt[rows], a, b[rows], c[rows], h)
            out.index_copy_(0, rows, y)
            write_states(ssm_state, spans, h)
        else:
            for i, (start, end) in enumerate(zip(spans.starts, spans.ends, strict=True)):
                h = sequence_state(ssm_state, spans, i, shape, torch.float32, x.device)
                out[start:end], h = ssd_sequence(x[start:end], dt[start:end], a, b[start:end], c[start:end], h,
                                                 self.sizes.chunk_size)
                store_sequence_state(ssm_state, spans, i, h)
        out = out + x * self.D.float()[:, None]
        return out.view(tokens, heads * head_dim)
