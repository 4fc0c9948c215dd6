"""fp8 (e4m3) quant_matmul through torch._scaled_mm: cuBLASLt's fp8 GEMM with row-wise scales.

The activation is quantized per token exactly as the reference does (scale = max|x_t| / 448),
then one fp8 x fp8 GEMM accumulates in fp32 (unit per-tensor scales, fp32 output) and the token
scales (M, 1) and the weight's per-channel scales (1, N) multiply that fp32 result. cuBLASLt wants K and N multiples of 16
(the weight, row-major (N, K), is passed transposed: column-major, as it requires); other
shapes take the reference body. torch on the CPU implements the same call, which is how the
mapping is tested without a GPU; speed needs an sm89+ GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import QuantizedWeight, quantize_activation_fp8
from flashllm.ops.quant_matmul import quant_matmul as reference

ALIGN = 16  # cuBLASLt fp8 GEMM: K and N must be multiples of 16


def aligned(weight: QuantizedWeight) -> bool:
    """Whether _scaled_mm can take this weight's shape."""
    return weight.in_features % ALIGN == 0 and weight.out_features % ALIGN == 0


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W.T + bias for an "fp8" weight (other schemes and unaligned shapes: the reference body).

    x (T, K) float; weight data float8_e4m3fn (N, K) with per-channel scales (N, 1); returns
    (T, N) in x.dtype, rounded once from fp32.
    """
    if weight.scheme != "fp8" or not aligned(weight) or x.shape[-1] != weight.in_features:
        return reference(x, weight, bias)
    if weight.input_perm is not None:
        x = x.index_select(-1, weight.input_perm)
    codes, x_scales = quantize_activation_fp8(x, weight.smooth)  # (T, K) e4m3, (T, 1) fp32
    # unit per-tensor scales keep the fp32 accumulator as it is (row-wise scales would force a
    # bfloat16 output on GPUs: a second rounding that fp16 and fp32 callers would see); the
    # token and channel scales are then applied in fp32, as the reference does, and rounded once
    one = torch.ones((), dtype=torch.float32, device=x.device)
    out = torch._scaled_mm(codes, weight.data.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    out = out * x_scales.float() * weight.scales.float().view(1, -1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
