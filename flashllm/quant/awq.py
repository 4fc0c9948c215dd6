"""AWQ (GEMM version) checkpoint tensors (qweight, qzeros, scales) <-> integer codes, and -> QuantizedWeight."""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.quant import gptq
from flashllm.quant.gptq import IntegerWeight, PrequantizedFormatError, default_g_idx, pack_words, unpack_words

__all__ = ["AWQ_BITS", "AWQ_PACK_ORDER", "pack_awq", "to_quantized_weight", "unpack_awq"]

AWQ_BITS = 4
# AWQ's GEMM kernels read 8 output columns per int32 interleaved: the nibble in slot i (bits
# 4i..4i+3) holds column AWQ_PACK_ORDER[i] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PER_WORD = 32 // AWQ_BITS


def pack_awq(codes: Tensor, zeros: Tensor, scales: Tensor) -> dict[str, Tensor]:
    """Integer codes -> the tensors an AWQ GEMM checkpoint stores for one linear layer.

    codes (N, K) and zeros (N, G) in 0..15, scales (N, G) float; N a multiple of 8. Returns
    {"qweight": int32 (K, N/8), "qzeros": int32 (G, N/8), "scales": fp16 (G, N)}, both packed
    along N in AWQ's interleaved order (zero points stored as they are).
    """
    n, groups = zeros.shape
    if codes.dim() != 2 or codes.shape[0] != n or tuple(scales.shape) != (n, groups):
        raise PrequantizedFormatError(
            f"codes {tuple(codes.shape)}, zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must be "
            "(N, K), (N, G), (N, G)"
        )
    return {
        "qweight": pack_words(codes.t(), AWQ_BITS, dim=1, order=AWQ_PACK_ORDER),
        "qzeros": pack_words(zeros.t(), AWQ_BITS, dim=1, order=AWQ_PACK_ORDER),
        "scales": scales.t().to(torch.float16).contiguous(),
    }


def unpack_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, *, group_size: int) -> IntegerWeight:
    """The tensors of one AWQ GEMM linear -> IntegerWeight (the inverse of pack_awq).

    qweight int32 (K, N/8); qzeros int32 (G, N/8); scales float (G, N) with G = K / group_size
    (1 for group_size -1). g_idx comes back as k // group_size: AWQ has no act order.
    """
    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise PrequantizedFormatError("AWQ qweight, qzeros and scales must be 2-D")
    k, n = qweight.shape[0], qweight.shape[1] * _PER_WORD
    if group_size != -1 and (group_size <= 0 or k % group_size):
        raise PrequantizedFormatError(f"AWQ group_size {group_size} must divide in_features {k}")
    groups = 1 if group_size == -1 else k // group_size
    for name, tensor, shape in (("qzeros", qzeros, (groups, n // _PER_WORD)), ("scales", scales, (groups, n))):
        if tuple(tensor.shape) != shape:
            raise PrequantizedFormatError(
                f"AWQ {name} has shape {tuple(tensor.shape)}, expected {shape} for group_size={group_size} and the "
                "qweight beside it; the checkpoint does not match its quantization_config"
            )
    if not scales.is_floating_point():
        raise PrequantizedFormatError(f"AWQ scales must be float, got {scales.dtype}")
    codes = unpack_words(qweight, AWQ_BITS, dim=1, order=AWQ_PACK_ORDER)
    zeros = unpack_words(qzeros, AWQ_BITS, dim=1, order=AWQ_PACK_ORDER)
    return IntegerWeight(codes.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous(),
                         default_g_idx(k, group_size), AWQ_BITS)


def to_quantized_weight(weight: IntegerWeight) -> QuantizedWeight:
    """IntegerWeight -> scheme "w4a16" QuantizedWeight (zero points kept unless all are 8)."""
    return gptq.to_quantized_weight(weight)
