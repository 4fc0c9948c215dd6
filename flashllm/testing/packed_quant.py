"""GPTQ / AWQ checkpoints made in tests: a round-to-nearest quantizer and packers written from the published
layouts (slot by slot, not through any quantization library), so loaders are checked against an independent
packing."""

from __future__ import annotations

import torch

AWQ_SLOT_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)  # column held by nibble i of an AWQ GEMM word


def pack_slots(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack along the last dim: word w's slot i (bits i*b..) holds value w*P + order[i]; int32 result."""
    per = 32 // bits
    words = torch.zeros(*values.shape[:-1], values.shape[-1] // per, dtype=torch.int64)
    for slot in range(per):
        source = slot if order is None else order[slot]
        words |= values[..., source::per].to(torch.int64) << (bits * slot)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the top bit is int32's sign


def quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, order: torch.Tensor, min_zero: int = 1):
    """Round-to-nearest codes (N, K), zero points (N, G) in min_zero..2**bits - 1, fp16 scales (N, G), g_idx (K,).

    order: the input features in quantization order; group g is order[g*gs:(g+1)*gs] (act order). min_zero 1
    keeps GPTQ v1's stored zero - 1 non-negative; formats that store the zero itself allow 0.
    """
    n, k = w.shape
    groups = 1 if group_size == -1 else k // group_size
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // (k // groups)
    top = 2**bits - 1
    codes = torch.empty(n, k, dtype=torch.int64)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    scales = torch.empty(n, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if sym:
            scale = (part.abs().amax(1) / (top // 2)).half()
            zero = torch.full((n,), 2 ** (bits - 1), dtype=torch.int64)
        else:
            low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scale = ((high - low) / top).half()
            zero = torch.round(-low / scale.float()).long().clamp(min_zero, top)
        codes[:, cols] = (torch.round(part / scale.float()[:, None]) + zero[:, None]).long().clamp(0, top)
        zeros[:, g], scales[:, g] = zero, scale
    return codes, zeros, scales, g_idx


def dequantized(codes, zeros, scales, g_idx) -> torch.Tensor:
    """The (N, K) fp32 weight quantize()'s codes stand for: (code - zero) * scale of each feature's group."""
    return (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def pack_gptq(codes, zeros, scales, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ tensors: qweight (K*bits/32, N) int32 packed along K, qzeros (G, N*bits/32) packed along N
    (v1 "gptq" format stores zero - 1), scales (G, N), g_idx (K,) int32."""
    return {"qweight": pack_slots(codes, bits).t().contiguous(),  # packed along K: (K * bits / 32, N)
            "qzeros": pack_slots((zeros - (1 if v1 else 0)).t(), bits),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def pack_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors (4 bits): qweight (K, N/8) and qzeros (G, N/8) packed along N in AWQ's
    nibble order, scales (G, N)."""
    return {"qweight": pack_slots(codes.t(), 4, AWQ_SLOT_COLUMN), "qzeros": pack_slots(zeros.t(), 4, AWQ_SLOT_COLUMN),
            "scales": scales.t().contiguous()}


def quantize_linear(weight: torch.Tensor, qconfig: dict, order: torch.Tensor | None = None
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the packed tensors of one linear, by `qconfig`'s quant_method / bits / group_size / sym /
    checkpoint_format, and the fp32 (N, K) weight they stand for). order: act order of the inputs."""
    method, bits, group = qconfig["quant_method"], qconfig["bits"], qconfig["group_size"]
    sym = qconfig.get("sym", method == "gptq")
    order = torch.arange(weight.shape[1]) if order is None else order
    codes, zeros, scales, g_idx = quantize(weight.float(), bits, group, sym, order)
    if method == "awq":
        packed = pack_awq(codes, zeros, scales)
    else:
        packed = pack_gptq(codes, zeros, scales, g_idx, bits, qconfig.get("checkpoint_format", "gptq") == "gptq")
    return packed, dequantized(codes, zeros, scales, g_idx)
