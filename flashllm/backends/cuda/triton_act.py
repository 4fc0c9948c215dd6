"""Triton gated activations: silu_and_mul and gelu_and_mul over a fused gate_up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last

SILU, GELU_ERF, GELU_TANH = 0, 1, 2
BLOCK = 1024


@triton.jit
def _gated_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate * tl.sigmoid(gate)
    elif ACT == 1:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))  # 1 / sqrt(2)
    else:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no tanh needed, and no cancellation for gate << 0
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) * (...)
        act = gate * tl.sigmoid(2.0 * inner)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _gated(op: str, x: torch.Tensor, act: int) -> torch.Tensor:
    """act(x[:, :I]) * x[:, I:] for x (T, 2I); returns a new (T, I) tensor in x.dtype."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(
            f"{op}: last dimension {x.shape[-1]} is odd; expected 2 * intermediate_size "
            "(gate columns followed by up columns)"
        )
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    unit_stride_last(op, x=x2)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(pow2(inter), BLOCK)
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _gated_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), inter, ACT=act, BLOCK=block, num_warps=4, **LAUNCH_OPTIONS
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, cast once: x (T, 2I) -> (T, I) in x.dtype (see the op spec)."""
    return _gated("silu_and_mul", x, SILU)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate, approximate) * up in fp32: x (T, 2I) -> (T, I); approximate "none" or "tanh"."""
    acts = {"none": GELU_ERF, "tanh": GELU_TANH}
    if approximate not in acts:
        raise ValueError(f"gelu_and_mul: approximate={approximate!r} is not supported; use one of {tuple(acts)}")
    return _gated("gelu_and_mul", x, acts[approximate])
