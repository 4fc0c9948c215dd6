"""fp8 (e4m3) quant_matmul through torch._scaled_mm: cuBLASLt's fp8 GEMM with row-wise scales.

The activation is quantized per token exactly as the reference does (scale = max|x_t| / 448),
then one fp8 x fp8 GEMM accumulates in fp32 and applies the token scales (M, 1) and the
weight's per-channel scales (1, N) in its epilogue. cuBLASLt wants K and N multiples of 16
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
    (T, N) in x.dtype. Row-wise-scaled _scaled_mm produces bfloat16 on GPUs, so the product is
    taken in bfloat16 there and fp32 on the CPU, then cast to x.dtype.
    """
    if weight.scheme != "fp8" or not aligned(weight) or x.shape[-1] != weight.in_features:
        return reference(x, weight, bias)
    if weight.input_perm is not None:
        x = x.index_select(-1, weight.input_perm)
    codes, x_scales = quantize_activation_fp8(x, weight.smooth)  # (T, K) e4m3, (T, 1) fp32
    out_dtype = torch.float32 if x.device.type == "cpu" else torch.bfloat16
    out = torch._scaled_mm(codes, weight.data.t(), scale_a=x_scales.float().contiguous(),
                           scale_b=weight.scales.float().view(1, -1).contiguous(), out_dtype=out_dtype)
    if bias is not None:
        out = out.float().add_(bias.float())
    return out.to(x.dtype)
