"""GGUF quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) as exact QuantizedWeights, no requantization."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flashllm.ops.quant_matmul import AFFINE_CAPABILITY, QuantizedWeight, pack_int4

T = GGMLQuantizationType
# Q5_0/Q5_1 too: llama.cpp writes them for K-quant files' tensors whose rows are not whole 256-feature
# super-blocks (every 896-wide row of Qwen2.5-0.5B's Q4_K_M is Q5_0, its Q5_K_M's Q5_1)
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K,
                                                              T.Q5_K, T.Q6_K, T.MXFP4})
SUPER_BLOCK = 256   # QK_K: the K-quants' super-block of features
K_SCALE_BYTES = 12  # the K-quants' packed 6-bit sub-block scales and minimums

# What each type becomes (the layout a kernel claiming AFFINE_CAPABILITY must run):
#   Q8_0  w8a16, group 32, fp16 scales d                       W = q * d
#   Q4_0  w4a16, group 32, fp16 scales d, implicit zero 8      W = (q - 8) * d
#   Q4_1  w4a16, group 32, fp16 scales d, fp16 offsets m       W = q * d + m
#   Q5_0  w8a16 (codes -16..15), group 32, fp16 scales d       W = (q - 16) * d
#   Q5_1  w8a16 (codes 0..31), group 32, fp16 d, fp16 offsets m W = q * d + m
#   Q4_K  w4a16, group 32, fp32 scales d*sc, offsets -dmin*m    W = q * (d*sc) - dmin*m
#   Q5_K  w8a16 (codes 0..31), group 32, as Q4_K               W = q * (d*sc) - dmin*m
#   Q6_K  w8a16 (codes -32..31), group 16, fp32 scales d*sc     W = q * (d*sc)
#   MXFP4 w8a16 (twice the e2m1 values: -12..12), group 32, fp32 scales 2^(e-128)   W = q * 2^(e-128)
# d*sc and dmin*m are one fp32 product each, as ggml forms them, so every element is ggml's bits.
GROUP = {T.Q8_0: 32, T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16,
         T.MXFP4: 32}
# MXFP4's e2m1 code points doubled (ggml's kvalues_mxfp4), by 4-bit code; its e8m0 exponent then halves the scale
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
MXFP4_EXPONENT_BIAS = 128  # 2^(e - 127) for the e2m1 values, 2^(e - 128) for their doubles


def _unsupported(ggml_type: object) -> ValueError:
    name = getattr(ggml_type, "name", repr(ggml_type))
    names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
    return ValueError(f"GGUF tensor type {name} has no flashllm quantized layout; supported: {names} "
                      "(float types F32/F16/BF16 load as plain weights)")


def request_quant(types: Iterable[GGMLQuantizationType]) -> str:
    """The quant capability a model holding tensors of these types asks the backend for: "none"
    when none is quantized, else AFFINE_CAPABILITY (every kernel claiming it runs every type here)."""
    return AFFINE_CAPABILITY if any(GGMLQuantizationType(t) in SUPPORTED_TYPES for t in types) else "none"


def row_bytes(ggml_type: GGMLQuantizationType, in_features: int) -> int:
    """Bytes one row of `in_features` features takes in `ggml_type` (in_features a whole number of blocks)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    return in_features // block * size


def block_of(ggml_type: GGMLQuantizationType | int) -> int:
    """Features a weight of this type must be cut at (a rank's share of a row-parallel layer): its
    block, 32, or 256 for the K-quants, whose activations llama.cpp rounds per 256 features too."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]


def _blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """raw's bytes as (N * K / block, type_size) uint8, after checking they are exactly the tensor's."""
    n, k = (int(v) for v in shape)
    block, size = GGML_QUANT_SIZES[ggml_type]
    if n <= 0 or k <= 0 or k % block:
        raise ValueError(f"a {ggml_type.name} weight needs in_features a positive multiple of {block} and "
                         f"out_features > 0, got shape (out, in) = {(n, k)}")
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise ValueError(f"weight_from_gguf takes the tensor's raw bytes as a uint8 numpy array (gguf.GGUFReader's "
                         f"ReaderTensor.data), got {type(raw).__name__} {getattr(raw, 'dtype', '')}")
    want = n * row_bytes(ggml_type, k)
    if raw.size != want:
        raise ValueError(f"a {ggml_type.name} weight of shape (out, in) = {(n, k)} is {want} bytes, the tensor "
                         f"holds {raw.size}: the file's shape or type is inconsistent")
    return np.ascontiguousarray(raw).reshape(-1, size)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as (B,) float16."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0]


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """(B, m, 32) bytes -> (B, m, 64) codes: each 32-byte run's low nibbles, then its high ones
    (the element order of Q4_0/Q4_1's 16-byte runs and the K-quants' 32-byte ones)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 12) packed bytes -> (sc, m) each (B, 8) uint8 in 0..63: sub-blocks 0-3 keep the low 6
    bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take a low nibble of bytes 8-11
    (scales: low, mins: high) and two high bits from the top of bytes 0-3 (scales) or 4-7 (mins)."""
    first, second, tail = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate((first & 0x3F, (tail & 0x0F) | ((first >> 6) << 4)), axis=-1)
    mins = np.concatenate((second & 0x3F, (tail >> 4) | ((second >> 6) << 4)), axis=-1)
    return sc, mins


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-sub-block (scale d*sc, offset -(dmin*m)) as (B, 8) fp32, each one fp32 product."""
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, mins = _k_scale_min(blocks[:, 4:4 + K_SCALE_BYTES])
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * mins.astype(np.float32))


def _decode(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes (B, block) uint8 or int8, scales (B, block / group), offsets or None) of raw blocks."""
    count = blocks.shape[0]
    if ggml_type == T.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks, 0)[:, None], None
    if ggml_type in (T.Q4_0, T.Q4_1):
        start = 2 if ggml_type == T.Q4_0 else 4
        codes = _nibbles_halves(blocks[:, start:start + 16][:, None, :]).reshape(count, 32)
        return codes, _f16(blocks, 0)[:, None], None if ggml_type == T.Q4_0 else _f16(blocks, 2)[:, None]
    if ggml_type in (T.Q5_0, T.Q5_1):  # 4 bytes of fifth bits (bit i: element i), then Q4_0's nibbles
        start = 2 if ggml_type == T.Q5_0 else 4
        fifth = np.unpackbits(blocks[:, start:start + 4], axis=-1, bitorder="little")
        codes = _nibbles_halves(blocks[:, start + 4:start + 20][:, None, :]).reshape(count, 32) | (fifth << 4)
        if ggml_type == T.Q5_0:
            return (codes.astype(np.int16) - 16).astype(np.int8), _f16(blocks, 0)[:, None], None
        return codes.view(np.int8), _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
    if ggml_type == T.Q4_K:
        scales, offsets = _k_affine(blocks)
        return _nibbles_halves(blocks[:, 16:144].reshape(count, 4, 32)).reshape(count, SUPER_BLOCK), scales, offsets
    if ggml_type == T.Q5_K:
        scales, offsets = _k_affine(blocks)
        low = _nibbles_halves(blocks[:, 48:176].reshape(count, 4, 32)).reshape(count, 8, 32)
        high = (blocks[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # bit i: sub-block i
        return (low | (high << 4)).reshape(count, SUPER_BLOCK).view(np.int8), scales, offsets
    if ggml_type == T.Q6_K:
        ql, qh = blocks[:, 0:128].reshape(count, 2, 2, 32), blocks[:, 128:192].reshape(count, 2, 1, 32)
        low = np.concatenate((ql & 0x0F, ql >> 4), axis=2)                        # (B, half, quarter, 32)
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(count, SUPER_BLOCK)
        sub = blocks[:, 192:208].view(np.int8).astype(np.float32)
        return codes, _f16(blocks, 208).astype(np.float32)[:, None] * sub, None
    if ggml_type == T.MXFP4:  # one e8m0 byte, then 16 bytes: element j's code is byte j's low nibble, j + 16's high
        codes = MXFP4_VALUES[_nibbles_halves(blocks[:, 1:17][:, None, :]).reshape(count, 32)]
        exponents = blocks[:, 0].astype(np.int32) - MXFP4_EXPONENT_BIAS
        return codes, np.ldexp(np.float32(1.0), exponents).astype(np.float32)[:, None], None
    raise _unsupported(ggml_type)


def weight_from_gguf(raw: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, int]) -> QuantizedWeight:
    """One 2-D GGUF weight as a QuantizedWeight that dequantizes to exactly gguf.quants.dequantize's values.

    raw: the tensor's bytes, uint8 (any shape; gguf.GGUFReader's ReaderTensor.data gives (N, row bytes));
    ggml_type: one of SUPPORTED_TYPES; shape: (out_features N, in_features K), K a whole number of
    blocks (32, or 256 for the K-quants). See GROUP's comment for each type's layout; int4 codes
    are repacked into flashllm's nibble order (low nibble = even feature). Raises ValueError naming
    the supported types, or the byte count expected, when the input does not fit.
    """
    try:
        ggml_type = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise _unsupported(ggml_type) from None
    if ggml_type not in SUPPORTED_TYPES:
        raise _unsupported(ggml_type)
    n, k = (int(v) for v in shape)
    codes, scales, offsets = _decode(_blocks(raw, ggml_type, (n, k)), ggml_type)
    group = GROUP[ggml_type]
    scales_t = torch.from_numpy(np.ascontiguousarray(scales).reshape(n, k // group))
    offsets_t = None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets).reshape(n, k // group))
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q4_K):
        data = pack_int4(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)))
        return QuantizedWeight("w4a16", data, scales_t, None, group, offsets=offsets_t, gguf_type=ggml_type.name)
    data = torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k).view(np.int8))
    return QuantizedWeight("w8a16", data, scales_t, None, group, offsets=offsets_t, gguf_type=ggml_type.name)


# The layout weight_from_gguf gives each type: (scheme, group, scale dtype, has offsets). Types of one
# layout join into one fused weight (Q4_K_M's qkv of 896-wide rows: q, k Q5_0 and v Q8_0).
_SCALES_FP16 = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})
_OFFSETS = frozenset({T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K})


def layout_of(ggml_type: GGMLQuantizationType | int) -> tuple[str, int, str, bool]:
    """(scheme, group, scale dtype, has offsets) of weight_from_gguf's weight for a SUPPORTED_TYPES type."""
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        raise _unsupported(ggml_type)
    scheme = "w4a16" if ggml_type in (T.Q4_0, T.Q4_1, T.Q4_K) else "w8a16"
    return scheme, GROUP[ggml_type], "float16" if ggml_type in _SCALES_FP16 else "float32", ggml_type in _OFFSETS
