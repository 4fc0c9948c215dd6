"""The ggml backend's kernels: each op's contract, computed with ggml's CPU float operations in its order."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flashllm.backends.ggml import numerics as g
from flashllm.ops import op_specs
from flashllm.ops._kv_checks import check_kv_scales
from flashllm.ops.paged_attention import _context_kv, _score_bias, refuse_unclaimed
from flashllm.ops.quant_matmul import QuantizedWeight, unpack_int4
from flashllm.ops.rope_cache import build_cos_sin_cache, rope_type_of
from flashllm.registry.backend import Backend, Caps

logger = logging.getLogger(__name__)

FP32 = frozenset({torch.float32})
# block types whose products are emulated in ggml's order (numerics.block_dot); others run the reference
EMULATED_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# rows of query tokens one attention call takes at a time: bounds the float64 temporaries of the emulated fma
_QUERY_CHUNK = 32
_warned: set[str] = set()


def _np(t: Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm as ggml_rms_norm followed by ggml_mul (numerics.rms_norm); x + residual is one fp32 add."""
    if residual is not None:
        x = x + residual
    rows = _np(x).reshape(-1, x.shape[-1])
    out = torch.from_numpy(g.rms_norm(rows, _np(weight), float(eps))).view(x.shape)
    return out if residual is None else (out, x)


def silu_and_mul(x: Tensor) -> Tensor:
    """ggml's fused SwiGLU (numerics.swiglu) of the [gate | up] columns."""
    if x.shape[-1] % 2:
        return op_specs()["silu_and_mul"].reference(x)  # the contract's error message
    gate, up = np.split(_np(x), 2, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(g.swiglu(gate, up)))


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor,
                     is_neox: bool) -> tuple[Tensor, Tensor]:
    """RoPE with ggml's per-pair arithmetic (numerics.rope_pairs) on the table given; pairs as the op says."""
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > q.shape[-1] or k.shape[-1] != q.shape[-1]:
        return op_specs()["rotary_embedding"].reference(positions, q, k, cos_sin_cache, is_neox)  # its error
    table = _np(cos_sin_cache[positions])
    cos, sin = table[:, None, : rot_dim // 2], table[:, None, rot_dim // 2:]

    def rotate(x: Tensor) -> Tensor:
        out = _np(x).copy()
        rot = out[..., :rot_dim]
        if is_neox:
            half = rot_dim // 2
            rot[..., :half], rot[..., half:] = g.rope_pairs(rot[..., :half], rot[..., half:], cos, sin)
        else:
            rot[..., 0::2], rot[..., 1::2] = g.rope_pairs(rot[..., 0::2], rot[..., 1::2], cos, sin)
        return torch.from_numpy(out)

    return rotate(q), rotate(k)


def ggml_cos_sin_table(rotary_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None,
                       dtype: torch.dtype = torch.float32) -> Tensor:
    """The [cos | sin] table (max_position, rotary_dim) fp32 with ggml's angles (numerics.rope_table: theta
    multiplied pair after pair in float32, libm's cosf / sinf). Rope scaling is not emulated: a scaled rope
    gets flashllm's own table (ops/rope_cache.py), said once in the log."""
    if rope_type_of(rope_scaling) != "default":
        _warn_once("rope", f"ggml backend: rope scaling {rope_type_of(rope_scaling)!r} uses flashllm's angle table, "
                   "not ggml's: results follow llama.cpp's order everywhere but the rotary angles")
        return build_cos_sin_cache(rotary_dim, max_position, base, rope_scaling, dtype)
    cos, sin = g.rope_table(range(max_position), rotary_dim, base)
    return torch.from_numpy(np.concatenate([cos, sin], axis=-1)).to(dtype)


# How the model layers meet this kernel's numerics (see ops/rotary_embedding.py): the table is built ggml's
# way, and GGUF Llama files keep their interleaved Q/K rows so that Q.K sums run in the file's feature order.
rotary_embedding.cos_sin_table = ggml_cos_sin_table  # type: ignore[attr-defined]
rotary_embedding.keeps_interleaved_pairs = True  # type: ignore[attr-defined]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                    seq_lens: Tensor, scale: float, alibi_slopes: Tensor | None = None,
                    sliding_window: int | None = None, k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None, logit_softcap: float | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """Attention as llama.cpp computes it without flash attention on an fp32 cache: Q.K by ggml_vec_dot_f32,
    soft_max_ext, then P.V by the 16-lane chain (a sequence with two or more query tokens in the step) or
    ggml_vec_dot_f32 (one query token). Each sequence gets the order it would get alone (batch-invariant)."""
    refuse_unclaimed("ggml", logit_softcap, sinks)
    reference = op_specs()["paged_attention"].reference
    if alibi_slopes is not None or k_cache.dtype != torch.float32 or q.shape[-1] % 64:
        return reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, alibi_slopes,
                         sliding_window, k_scale, v_scale)  # not emulated (never bound: the caps exclude it)
    mode = check_kv_scales("paged_attention", k_cache, k_scale, v_scale)
    head_dim = q.shape[-1]
    # ggml's kq_scale is 1.0f / sqrtf(head_dim); the model's head_dim ** -0.5 may sit one float32 ulp away
    f32_scale = g.F32(1) / np.sqrt(g.F32(head_dim)) if abs(scale - head_dim**-0.5) < 1e-9 else g.F32(scale)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b, seq_len in enumerate(lens):
        start, q_len = starts[b], starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        pad = -seq_len % 64  # zero keys and values past the context change no sum (llama.cpp pads to 256)
        keys = np.pad(_np(_context_kv(k_cache, k_scale, mode, block_tables[b], seq_len)), ((0, pad), (0, 0), (0, 0)))
        values = np.pad(_np(_context_kv(v_cache, v_scale, mode, block_tables[b], seq_len)), ((0, pad), (0, 0), (0, 0)))
        k_pos = torch.arange(seq_len)
        bias = _score_bias(k_pos[seq_len - q_len:], k_pos, None, sliding_window)[0].numpy()
        mask = np.pad(bias, ((0, 0), (0, pad)), constant_values=-np.inf).astype(g.F32)
        keys_h = keys.transpose(1, 0, 2)[:, None]                          # (Hk, 1, L, D)
        values_h = values.transpose(1, 2, 0)[:, None]                      # (Hk, 1, D, L)
        dot = g.dot_chain16 if q_len >= 2 else g.dot_f32
        queries = _np(q[start:start + q_len]).transpose(1, 0, 2)           # (Hq, q_len, D)
        result = np.empty((q_len, q.shape[1], head_dim), g.F32)
        for lo in range(0, q_len, _QUERY_CHUNK):
            hi = min(lo + _QUERY_CHUNK, q_len)
            for h in range(q.shape[1]):
                scores = g.dot_f32(queries[h, lo:hi, None, :], keys_h[h // group])    # (rows, L)
                probs = g.softmax(scores, mask[lo:hi], float(f32_scale))
                result[lo:hi, h] = dot(probs[:, None, :], values_h[h // group])         # (rows, D)
        out[start:start + q_len] = torch.from_numpy(result)
    return out


def _blocks_of(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray] | None:
    """(d (N, K/32) fp32, codes (N, K/32, 32) int64, minimums or None, lane_codes(codes)) of a Q8_0 / Q4_0 /
    Q4_1 weight as block_dot takes them, built once per weight; None for a weight whose blocks are not emulated."""
    cached = weight.kernel_cache.get("ggml")
    if cached is not None:
        return cached if cached != "none" else None
    kind, blocks = weight.gguf_type, None
    n, k = weight.out_features, weight.in_features
    if weight.input_perm is None and weight.group_size == 32 and weight.zeros is None:
        if kind == "Q8_0" and weight.scheme == "w8a16" and weight.offsets is None:
            blocks = (weight.scales, weight.data.to(torch.int64), None)
        elif kind == "Q4_0" and weight.scheme == "w4a16" and weight.offsets is None:
            blocks = (weight.scales, unpack_int4(weight.data).to(torch.int64) - 8, None)
        elif kind == "Q4_1" and weight.scheme == "w4a16" and weight.offsets is not None:
            blocks = (weight.scales, unpack_int4(weight.data).to(torch.int64), weight.offsets)
    if kind == "Q8_0" and weight.scheme == "none" and k % 32 == 0:
        blocks = _q8_0_from_float(weight.data)
    if blocks is None:
        weight.kernel_cache["ggml"] = "none"
        return None
    d, codes, minimums = blocks
    grouped = codes.reshape(n, k // 32, 32).numpy()
    found = (_np(d), grouped, None if minimums is None else _np(minimums), g.lane_codes(grouped))
    weight.kernel_cache["ggml"] = found
    return found


def _q8_0_from_float(w: Tensor) -> tuple[Tensor, Tensor, None] | None:
    """A float head read from Q8_0 blocks (the tied token embedding) back as its blocks: a block's scale is
    its largest |value| / 127 (ggml's quantizer puts the largest code at +-127), its codes value / scale.
    None unless every value comes back exactly (then the blocks are the file's)."""
    blocks = w.detach().float().reshape(w.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127
    codes = torch.where(d[..., None] > 0, blocks / d.clamp_min(1e-30)[..., None], 0).round()
    exact = (torch.equal(d.half().float(), d) and bool((codes.abs() <= 127).all())
             and torch.equal((codes * d[..., None]).float(), blocks))
    return (d, codes.to(torch.int64), None) if exact else None


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """GGUF Q8_0 / Q4_0 / Q4_1 weights (and a float head read from Q8_0) as ggml's vec_dot against q8_0 / q8_1
    activation blocks (numerics.block_dot); every other weight by the reference body, said once in the log."""
    blocks = _blocks_of(weight) if x.shape[-1] == weight.in_features else None
    if blocks is None:
        _warn_once(f"qm-{weight.scheme}-{weight.gguf_type}",
                   f"ggml backend: a {weight.gguf_type or weight.scheme} weight is not in ggml's emulated block "
                   f"types ({', '.join(EMULATED_TYPES)}); it runs the reference quant_matmul")
        return op_specs()["quant_matmul"].reference(x, weight, bias)
    rows = _np(x).reshape(-1, x.shape[-1])
    out = torch.from_numpy(g.block_dot(rows, *blocks)).view(*x.shape[:-1], weight.out_features)
    return out if bias is None else out + bias.float()


def register(backend: Backend) -> None:
    """Register the emulated kernels (fp32 only), and the exact reference bodies of the ops with no rounding."""
    emulated: dict[str, tuple[Any, Caps]] = {
        "rms_norm": (rms_norm, Caps(dtypes=FP32)),
        "silu_and_mul": (silu_and_mul, Caps(dtypes=FP32)),
        "rotary_embedding": (rotary_embedding, Caps(dtypes=FP32)),
        "paged_attention": (paged_attention, Caps(dtypes=FP32, kv_dtypes=FP32,
                                                  head_sizes=frozenset({64, 128, 192, 256}), graph_safe=False)),
        "quant_matmul": (quant_matmul, Caps(dtypes=FP32, quant=frozenset({"none", "gguf"}))),
    }
    for op, (fn, caps) in emulated.items():
        backend.kernel(op, caps)(fn)
    # storing K and V in an fp32 cache is a copy: the portable body is llama.cpp's arithmetic too
    backend.kernel("write_kv_cache", Caps(dtypes=FP32, kv_dtypes=FP32, graph_safe=False))(
        op_specs()["write_kv_cache"].reference)
