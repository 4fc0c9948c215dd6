"""Triton fused_moe: a grouped GEMM over (token, expert) pairs sorted by expert.

1. `align_by_expert` (torch, no host sync: graph-capturable) sorts the T*k pairs by expert and
   pads each expert's run to a multiple of BLOCK_M, so every M tile of rows belongs to one expert.
2. `_gate_up_kernel`: per tile, x rows @ w13[e].T for the gate and the up half at once, then
   silu(gate) * up in fp32, stored per pair in x.dtype (T*k, I).
3. `_down_kernel`: per tile, intermediate @ w2[e].T times the pair's routing weight, stored per
   pair in fp32 (T*k, H).
   With w8a16 experts (QUANT) both GEMMs multiply by the int8 codes converted to x.dtype (exact:
   |code| <= 127 fits fp16's and bf16's significands) and scale each fp32 output column by its
   channel's scale once after the K loop: sum_k x[k] * code[n, k] * scale[n] factored, so the
   codes stream at one byte per weight and nothing is dequantized in memory.
4. A second reduction pass sums each token's k rows in slot order and rounds once to x.dtype.
   Chosen over atomic adds into (T, H): it is deterministic (the same bits on every run, which
   fp32 atomics are not), needs no zeroed output or bf16 atomics, and costs T*k*H*4 bytes of
   traffic, small beside the expert weights the GEMMs stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashllm.backends.cuda.launch import LAUNCH_OPTIONS, pow2, unit_stride_last, widen_bf16
from flashllm.backends.cuda.triton_attention_kernels import _mma
from flashllm.ops.fused_moe import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, check_expert_biases, check_expert_scales


@triton.jit
def _operand(w, like, WIDEN: tl.constexpr):
    """A weight tile as the dot's operand beside `like`: like's dtype, or fp32 where WIDEN (the interpreter
    converts int8 codes to bf16 wrongly; both are exact for codes and bf16 weights)."""
    if WIDEN:
        return w.to(tl.float32)
    return w.to(like.dtype)


@triton.jit
def _tile_rows(sorted_pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """(expert of this M tile or -1, its pair ids (BLOCK_M,), which of them are real pairs)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, scale_ptr, bias_ptr, inter_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_be, stride_it,
    QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLUOAI: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, pairs, valid = _tile_rows(sorted_pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return  # a tile past the last expert's padded run
    tokens = (pairs // top_k).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    w_expert = w13_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_expert + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        w_up = tl.load(w_expert + (n[None, :] + inter) * stride_wn + k[:, None], mask=w_mask, other=0.0)
        gate += _mma(x, _operand(w_gate, x, WIDEN), WIDEN)
        up += _mma(x, _operand(w_up, x, WIDEN), WIDEN)
    if QUANT:  # per output channel: the gate's scales, then the up half's
        s_expert = scale_ptr + expert.to(tl.int64) * stride_se
        gate *= tl.load(s_expert + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        up *= tl.load(s_expert + inter + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:  # gpt-oss: a bias per expert and feature, the gate's then the up half's
        b_expert = bias_ptr + expert.to(tl.int64) * stride_be
        gate += tl.load(b_expert + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_expert + inter + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLUOAI:  # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    else:
        act = gate * tl.sigmoid(gate) * up
    out = inter_ptr + pairs.to(tl.int64)[:, None] * stride_it + n[None, :]
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w2_ptr, scale_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_it, stride_we, stride_wn, stride_se, stride_be, stride_ot,
    QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, pairs, valid = _tile_rows(sorted_pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    rows = pairs.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    w_expert = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inter
        a = tl.load(inter_ptr + rows[:, None] * stride_it + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_expert + n[None, :] * stride_wn + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += _mma(a, _operand(w, a, WIDEN), WIDEN)
    if QUANT:
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * stride_se + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    out = out_ptr + rows[:, None] * stride_ot + n[None, :]
    tl.store(out, acc * routing[:, None], mask=valid[:, None] & n_mask[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by expert, each expert's run padded to a multiple of block_m.

    topk_ids (T, k) int: pair p = t * k + j routes token t to expert topk_ids[t, j].
    Returns (sorted_pairs (num_blocks * block_m,) int32, padding = T*k; block_expert
    (num_blocks,) int32, the expert of each M tile or -1 past the last run). Sizes depend only
    on T, k and num_experts, and nothing is read back to the host: CUDA graphs can capture it.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # scatter/gather indices must be int64
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    # every non-empty expert pads by at most block_m - 1 rows
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"fused_moe: shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit "
            "x (T, H), w13 (E, 2I, H), w2 (E, H, I)"
        )
    unit_stride_last("fused_moe", x=x, w13=w13, w2=w2)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    # out-of-range ids would read outside w13; the check reads back to the host, so a graph
    # capture (where ids come from the model's own top-k) skips it
    if not capturing and topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if not 0 <= low <= high < num_experts:
            raise ValueError(
                f"fused_moe: topk_ids range [{low}, {high}] is outside [0, {num_experts}) for {num_experts} experts"
            )


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None) -> bool:
    """Whether the experts are w8a16 (int8 with (E, N) scales); raise ValueError for int4 or malformed ones."""
    check_expert_scales(w13, w2, w13_scale, w2_scale)
    if w13_scale is None:
        return False
    if w13.dtype != torch.int8 or w2.dtype != torch.int8:
        raise ValueError(f"the Triton fused_moe kernel takes float or int8 (w8a16) experts, not {w13.dtype} / "
                         f"{w2.dtype} (packed int4, w4a16): its caps claim 'none' and 'w8a16' only")
    return True


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: about the mean rows per expert, so decode pads little and prefill reuses weights."""
    return min(max(pow2(num_pairs // max(num_experts, 1)), 16), 64)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, activation: str = "silu",
) -> torch.Tensor:
    """Routed experts' gated MLPs, weighted and summed per token: x (T, H) -> (T, H) in x.dtype.

    w13 (E, 2I, H) gate rows then up rows; w2 (E, H, I); topk_weights (T, k) float; topk_ids (T, k)
    int. Semantics as `flashllm.ops.fused_moe`; the dot operands are x.dtype (weights cast to it),
    fp32 accumulation, and the intermediate silu(gate) * up is rounded to x.dtype. Experts are float
    (no scales) or "w8a16": int8 w13 / w2 with float w13_scale (E, 2I) and w2_scale (E, H), one scale
    per expert and output channel. The caps claim those two; int4 experts ("w4a16") run elsewhere. Biases and
    the "swigluoai" activation (gpt-oss) are applied in fp32 before the rounding.
    """
    check_expert_biases(w13, w2, w13_bias, w2_bias, activation)
    quant = _check_scales(w13, w2, w13_scale, w2_scale)
    _check(x, w13, w2, topk_ids)
    tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter, num_pairs = two_inter // 2, tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = _block_m(num_pairs, num_experts)
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, block_m)
    intermediate = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    widen = widen_bf16(_gate_up_kernel, x.dtype)
    block_n, num_blocks = 64, block_expert.numel()
    # without scales the kernels never read the scale pointer: the weights stand in for it
    s13, s2 = (w13_scale.contiguous(), w2_scale.contiguous()) if quant else (w13, w2)
    # likewise without biases
    b13, b2 = (w13_bias.contiguous(), w2_bias.contiguous()) if w13_bias is not None else (w13, w2)
    has_bias = w13_bias is not None
    if has_bias != (w2_bias is not None):
        raise ValueError("the Triton fused_moe kernel takes both expert biases (w13_bias and w2_bias) or neither")
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, s13, b13, intermediate, sorted_pairs, block_expert,
        num_pairs, top_k, hidden, inter, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), b13.stride(0), intermediate.stride(0),
        QUANT=quant, HAS_BIAS=has_bias, SWIGLUOAI=activation == "swigluoai", WIDEN=widen, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=min(pow2(hidden, 16), 64), num_warps=4, **LAUNCH_OPTIONS,
    )
    routing = topk_weights.reshape(-1).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        intermediate, w2, s2, b2, routing, per_pair, sorted_pairs, block_expert,
        num_pairs, hidden, inter,
        intermediate.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), b2.stride(0), per_pair.stride(0),
        QUANT=quant, HAS_BIAS=has_bias, WIDEN=widen, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=min(pow2(inter, 16), 64), num_warps=4, **LAUNCH_OPTIONS,
    )
    # the second reduction pass: each token's k weighted expert rows, in slot order
    return per_pair.view(tokens, top_k, hidden).sum(1).to(x.dtype)
