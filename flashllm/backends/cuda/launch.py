"""Launch helpers shared by the Triton kernel modules (imports triton: load only from them)."""

from __future__ import annotations

from typing import Any

import torch
import triton

# Launch options every kernel passes. FMA fusion is pinned on (one rounding per multiply-add:
# at least as close to the fp32 reference as separate ops) rather than left to a default that
# Triton 3.10 flips.
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": True}


def interpreted(kernel: Any) -> bool:
    """Whether `kernel` was decorated under TRITON_INTERPRET=1 (it then runs in numpy on the host).

    Triton decides at decoration time, so this is what matters, not the variable's current value.
    """
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a triton without an interpreter cannot have produced one
        return False
    return isinstance(kernel, InterpretedFunction)


def widen_bf16(kernel: Any, dtype: torch.dtype) -> bool:
    """Whether dot operands of `dtype` must be widened to fp32 before tl.dot.

    The Triton 3.x interpreter multiplies bf16 tensors as their raw uint16 bits; conversions are
    right, so interpreted kernels widen bf16 operands (after any rounding a GPU run does) to fp32.
    bf16 x bf16 products are exact in fp32, so only the accumulation order differs from a GPU.
    """
    return dtype == torch.bfloat16 and interpreted(kernel)


def unit_stride_last(op: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor's last dimension is contiguous (stride 1)."""
    for name, tensor in tensors.items():
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(
                f"{op}: {name} has stride {tensor.stride(-1)} in its last dimension; the Triton kernel "
                f"needs it contiguous (stride 1): pass {name}.contiguous()"
            )


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(triton.next_power_of_2(max(n, 1)), minimum)
