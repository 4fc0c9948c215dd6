"""npu kernels: flashllm ops mapped onto torch_npu's documented fused ops, imported on first call.

Sources (Ascend Extension for PyTorch API reference, torch_npu 7.0.0): npu_rms_norm,
npu_rotary_mul (rotary_mode "half" / "interleave"), npu_incre_flash_attention,
npu_fused_infer_attention_score, npu_weight_quant_batchmatmul, npu_convert_weight_to_int4pack.
write_kv_cache has no public torch_npu op, so it is the torch-native scatter from xpu/native.py.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.backends.xpu import native
from flashllm.ops._kv_checks import reject_quantized_kv
from flashllm.ops.paged_attention import refuse_unclaimed
from flashllm.ops.quant_matmul import INT4_SYMMETRIC_ZERO, QuantizedWeight, integer_codes
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
HALF = frozenset({torch.float16, torch.bfloat16})
# Paged attention (ATB PagedAttention / IFA page-attention constraints): block_size % 16 == 0,
# head_size in (0, 256], block_size * head_size <= 128 * 128 on older CANN. Caps cannot express
# the product, so only pairs that satisfy it for every listed value are claimed.
ATTENTION_HEAD_SIZES = frozenset({64, 80, 96, 128})
ATTENTION_BLOCK_SIZES = frozenset({16, 32, 64, 128})


def vendor() -> ModuleType:
    """torch_npu, imported on the first kernel call (never at registration)."""
    return importlib.import_module("torch_npu")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """npu_rms_norm(x, gamma, epsilon) -> (y, rstd); gamma must share x's dtype. Residual add first, in x.dtype."""
    if residual is not None:
        x = x + residual
    normed, _rstd = vendor().npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)
    return normed if residual is None else (normed, x)


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """npu_rotary_mul(x, r1=cos, r2=sin, rotary_mode) on 4-D BSND views, in fp32 like the reference.

    "half" pairs feature i with i + rot_dim/2 (neox), "interleave" pairs 2i with 2i+1; r1/r2 carry
    each pair's angle on both of its features, so cos/sin are duplicated to the full rot_dim.
    Partial rotary: only the first rot_dim features go through the op.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # (T, rot_dim / 2) each
    if is_neox:
        r1, r2, mode = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), "half"
    else:
        r1, r2, mode = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), "interleave"
    r1, r2 = r1[None, :, None, :], r2[None, :, None, :]  # (1, T, 1, rot_dim) broadcast over heads
    return _rotate(q, r1, r2, mode, rot_dim), _rotate(k, r1, r2, mode, rot_dim)


def _rotate(x: Tensor, r1: Tensor, r2: Tensor, mode: str, rot_dim: int) -> Tensor:
    rotated = vendor().npu_rotary_mul(x[..., :rot_dim].float().unsqueeze(0).contiguous(), r1, r2, rotary_mode=mode)
    rotated = rotated.squeeze(0).to(x.dtype)
    return rotated if rot_dim == x.shape[-1] else torch.cat((rotated, x[..., rot_dim:]), dim=-1)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    alibi_slopes: Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """All-decode batches: one npu_incre_flash_attention; otherwise one npu_fused_infer_attention_score.

    Both read the paged cache in place ("BSH" layout, cache viewed as (num_blocks, block_size,
    Hk*D)) through block_table (int32) and the per-sequence KV lengths; the prefill call takes
    queries padded to (B, max_q, Hq*D), their lengths, and an explicit boolean mask (True = masked)
    placing each sequence's queries at its last q_len positions (prefix caching, chunked prefill)
    and applying the sliding window.
    """
    reject_quantized_kv("paged_attention", k_cache, k_scale, v_scale)
    refuse_unclaimed("npu", logit_softcap, sinks)
    if alibi_slopes is not None:
        raise NotImplementedError(
            "npu paged_attention: ALiBi is not mapped (torch_npu's pse_shift semantics are not verified) and its "
            "caps do not claim it; resolve the op table with OpRequest(alibi=True) to bind the reference kernel"
        )
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    geometry = dict(num_heads=q.shape[1], num_key_value_heads=num_kv_heads, input_layout="BSH", block_size=block_size)
    paged = (k_cache.view(num_blocks, block_size, -1), v_cache.view(num_blocks, block_size, -1))
    out = torch.zeros_like(q)
    if all(n == 1 for n in q_lens) and sliding_window is None:
        batch = len(q_lens)
        attn = vendor().npu_incre_flash_attention(
            q[:batch].reshape(batch, 1, -1), *paged, actual_seq_lengths=lens,
            block_table=block_tables.to(torch.int32), scale_value=scale, **geometry,
        )
        out[:batch] = attn.view(batch, q.shape[1], head_size)
        return out
    padded, mask = _pad_queries(q, starts, q_lens, lens, block_tables.shape[1] * block_size, sliding_window)
    attn, _lse = vendor().npu_fused_infer_attention_score(
        padded.flatten(2), *paged, atten_mask=mask, actual_seq_lengths=q_lens, actual_seq_lengths_kv=lens,
        block_table=block_tables.to(torch.int32), scale=scale, sparse_mode=0, **geometry,
    )
    attn = attn.view(padded.shape)
    for b, (start, q_len) in enumerate(zip(starts[:-1], q_lens, strict=True)):
        out[start : start + q_len] = attn[b, :q_len]
    return out


def _pad_queries(
    q: Tensor, starts: list[int], q_lens: list[int], lens: list[int], kv_span: int, sliding_window: int | None
) -> tuple[Tensor, Tensor]:
    """Queries (B, max_q, Hq, D) zero-padded, and the mask (B, 1, max_q, kv_span) bool, True = masked."""
    batch, max_q = len(q_lens), max(q_lens)
    padded = q.new_zeros(batch, max_q, *q.shape[1:])
    q_pos = torch.empty(batch, max_q, dtype=torch.long, device=q.device)
    for b, (start, q_len, seq_len) in enumerate(zip(starts[:-1], q_lens, lens, strict=True)):
        padded[b, :q_len] = q[start : start + q_len]
        q_pos[b] = torch.arange(seq_len - q_len, seq_len - q_len + max_q, device=q.device)
    distance = q_pos[:, :, None] - torch.arange(kv_span, device=q.device)[None, None, :]
    masked = distance < 0
    if sliding_window is not None:
        masked |= distance >= sliding_window
    return padded, masked.unsqueeze(1)


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """"none": F.linear; "w8a16"/"w4a16": npu_weight_quant_batchmatmul(x, W (K, N), antiquant_scale, offset).

    The op computes x @ ((W + antiquant_offset) * antiquant_scale): int8 codes pass as they are;
    int4 codes c in 0..15 pass as signed c - 8 packed by npu_convert_weight_to_int4pack (8 per
    int32 along N, so N is zero-padded to a multiple of 8 and the output sliced back), with offset
    8 - zero for asymmetric weights. Scales are (1, N) per channel or (K / group, N) per group
    (antiquant_group_size). The re-laid-out tensors are built once, in weight.kernel_cache.
    """
    if weight.input_perm is not None:  # act-order (GPTQ desc_act) weights store their columns permuted
        x = x.index_select(-1, weight.input_perm)
    if weight.scheme == "none":
        return F.linear(x, weight.data.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    packed, scale, offset = _npu_weight(weight)
    n = weight.out_features
    if bias is not None and scale.shape[1] != n:
        bias = F.pad(bias, (0, scale.shape[1] - n))
    out = vendor().npu_weight_quant_batchmatmul(
        x, packed, scale.to(x.dtype), antiquant_offset=None if offset is None else offset.to(x.dtype),
        bias=None if bias is None else bias.float(),
        antiquant_group_size=0 if weight.group_size == -1 else weight.group_size,
    )
    return out[:, :n]


def _npu_weight(weight: QuantizedWeight) -> tuple[Tensor, Tensor, Tensor | None]:
    """(weight (K, N') for the vendor op, scale (groups, N') fp32, offset (groups, N') fp32 or None)."""
    cache = weight.kernel_cache
    if "npu_weight" not in cache:
        scale = weight.scales.t().float()  # (groups, N)
        if weight.scheme == "w8a16":
            cache["npu_weight"], cache["npu_scale"] = weight.data.t(), scale
        else:
            codes, zero = integer_codes(weight)  # (N, K) in 0..15, (N, groups)
            pad = -weight.out_features % 8
            signed = F.pad(codes - INT4_SYMMETRIC_ZERO, (0, 0, 0, pad)).t().contiguous()  # (K, N') in -8..7
            cache["npu_weight"] = vendor().npu_convert_weight_to_int4pack(signed)
            cache["npu_scale"] = F.pad(scale, (0, pad))
            if weight.zeros is not None:
                cache["npu_offset"] = F.pad((INT4_SYMMETRIC_ZERO - zero).t().float(), (0, pad))
    return cache["npu_weight"], cache["npu_scale"], cache.get("npu_offset")


# Dtypes: npu_rms_norm and npu_rotary_mul take float16/bfloat16/float32; the attention and
# weight-quant ops float16/bfloat16 only (x in float16/bfloat16, weights int8 or int4-in-int32).
KERNELS: tuple[tuple[str, object, Caps], ...] = (
    ("rms_norm", rms_norm, Caps(dtypes=FLOATS)),
    ("rotary_embedding", rotary_embedding, Caps(dtypes=FLOATS)),  # 7.0.0: any even rotary dim < 896
    ("write_kv_cache", native.write_kv_cache, Caps(dtypes=FLOATS, kv_dtypes=FLOATS)),
    ("paged_attention", paged_attention, Caps(
        dtypes=HALF, kv_dtypes=HALF, head_sizes=ATTENTION_HEAD_SIZES, block_sizes=ATTENTION_BLOCK_SIZES,
    )),
    ("quant_matmul", quant_matmul, Caps(dtypes=FLOATS, quant=frozenset({"none"}))),
    ("quant_matmul", quant_matmul, Caps(dtypes=HALF, quant=frozenset({"w8a16", "w4a16"}))),
)


def register(backend: Backend) -> None:
    """Register the torch_npu-mapped kernels on `backend`; silu/gelu_and_mul and fused_moe run the reference."""
    for op, fn, caps in KERNELS:
        backend.kernel(op, caps)(fn)
