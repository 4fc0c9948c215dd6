"""GPTQ checkpoint tensors (qweight, qzeros, scales, g_idx) <-> integer codes, and -> QuantizedWeight."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import INT4_SYMMETRIC_ZERO, QuantizedWeight, pack_int4

__all__ = [
    "GPTQ_BITS",
    "GPTQ_FORMATS",
    "IntegerWeight",
    "PrequantizedFormatError",
    "concat_output_shards",
    "default_g_idx",
    "pack_gptq",
    "pack_words",
    "to_quantized_weight",
    "unpack_gptq",
    "unpack_words",
]

GPTQ_BITS = (4, 8)
# "gptq" (v1) stores every zero point minus one; "gptq_v2" stores it as is
GPTQ_FORMATS = ("gptq", "gptq_v2")
WORD_BITS = 32
INT8_SYMMETRIC_ZERO = 128  # an unsigned 8-bit code c stands for c - 128 in a symmetric checkpoint


class PrequantizedFormatError(ValueError):
    """Published quantized tensors that do not fit their format, or that flashllm cannot run."""


@dataclass(frozen=True, slots=True)
class IntegerWeight:
    """A weight as integers: W[n, k] = (codes[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]].

    codes: int32 (N, K) in 0..2**bits - 1; zeros: int32 (N, G); scales: float (N, G) in the
    checkpoint's dtype; g_idx: int64 (K,), the group of each input feature (k // group_size
    unless the checkpoint was quantized in activation order).
    """

    codes: Tensor
    zeros: Tensor
    scales: Tensor
    g_idx: Tensor
    bits: int

    def dequantize(self) -> Tensor:
        """The (N, K) fp32 weight the integers stand for."""
        g = self.g_idx
        return (self.codes - self.zeros[:, g]).to(torch.float32) * self.scales.to(torch.float32)[:, g]


def _check_bits(bits: int, allowed: tuple[int, ...], what: str) -> None:
    if bits not in allowed:
        raise PrequantizedFormatError(f"{what} bits={bits} is not supported; flashllm loads bits in {allowed}")


def pack_words(codes: Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> Tensor:
    """Pack unsigned `bits`-wide codes along `dim` into int32 words, the lowest bits first.

    Word w holds codes w*P .. w*P + P - 1 (P = 32 / bits); with `order`, slot i of a word holds
    code order[i] of its P codes instead of code i. The size of `dim` must be a multiple of P.
    """
    per_word = WORD_BITS // bits
    codes = codes.movedim(dim, -1).to(torch.int64)
    if codes.shape[-1] % per_word:
        raise PrequantizedFormatError(f"cannot pack {codes.shape[-1]} codes into whole {bits}-bit words of {per_word}")
    if bool((codes < 0).any()) or bool((codes >> bits).any()):
        raise PrequantizedFormatError(f"codes must lie in 0..{2**bits - 1} to pack them in {bits} bits")
    slots = codes.reshape(*codes.shape[:-1], -1, per_word)
    if order is not None:
        slots = slots[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (slots << shifts).sum(dim=-1)
    # the top code lands in the sign bit: wrap to the int32 a checkpoint stores
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def unpack_words(words: Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> Tensor:
    """The inverse of pack_words: int32 words -> int32 codes, `32 / bits` times longer along `dim`."""
    if words.dtype != torch.int32:
        raise PrequantizedFormatError(f"packed tensors are int32, got {words.dtype}")
    per_word = WORD_BITS // bits
    words = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    slots = (words[..., None] >> shifts) & (2**bits - 1)
    if order is not None:
        slots = slots[..., _inverse(order)]
    return slots.flatten(-2).to(torch.int32).movedim(-1, dim)


def _inverse(order: tuple[int, ...]) -> list[int]:
    inverse = [0] * len(order)
    for slot, code in enumerate(order):
        inverse[code] = slot
    return inverse


def default_g_idx(in_features: int, group_size: int) -> Tensor:
    """int64 (K,): k // group_size, or all zeros for group_size -1."""
    k = torch.arange(in_features, dtype=torch.int64)
    return torch.zeros_like(k) if group_size == -1 else k // group_size


def pack_gptq(codes: Tensor, zeros: Tensor, scales: Tensor, g_idx: Tensor | None = None, *, bits: int,
              checkpoint_format: str = "gptq") -> dict[str, Tensor]:
    """Integer codes -> the tensors a GPTQ checkpoint stores for one linear layer.

    codes (N, K) and zeros (N, G) in 0..2**bits - 1 (v1 "gptq": zeros in 1..2**bits, since it
    stores zero - 1); scales (N, G) float; g_idx (K,) group per input feature (None: all in
    group 0 when G == 1, else k // (K / G)). Returns {"qweight": int32 (K*bits/32, N),
    "qzeros": int32 (G, N*bits/32), "scales": fp16 (G, N), "g_idx": int32 (K,)}.
    """
    _check_bits(bits, GPTQ_BITS, "GPTQ")
    if checkpoint_format not in GPTQ_FORMATS:
        raise PrequantizedFormatError(f"checkpoint_format {checkpoint_format!r} is not one of {GPTQ_FORMATS}")
    n, k = codes.shape
    groups = zeros.shape[1]
    if tuple(zeros.shape) != (n, groups) or tuple(scales.shape) != (n, groups):
        raise PrequantizedFormatError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must both be (N={n}, G)")
    if g_idx is None:
        g_idx = default_g_idx(k, -1 if groups == 1 else k // groups)
    stored_zeros = zeros.to(torch.int64) - (1 if checkpoint_format == "gptq" else 0)
    return {
        "qweight": pack_words(codes.t(), bits, dim=0),
        "qzeros": pack_words(stored_zeros.t(), bits, dim=1),
        "scales": scales.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def unpack_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None, *, bits: int,
                group_size: int, checkpoint_format: str = "gptq") -> IntegerWeight:
    """The tensors of one GPTQ linear -> IntegerWeight (the inverse of pack_gptq).

    qweight int32 (K*bits/32, N); qzeros int32 (G, N*bits/32); scales float (G, N); g_idx
    int (K,) or None (then k // group_size). G must be 1 for group_size -1, else
    ceil(K / group_size). v1 zero points come back as stored + 1 (1..2**bits).
    """
    _check_bits(bits, GPTQ_BITS, "GPTQ")
    if checkpoint_format not in GPTQ_FORMATS:
        raise PrequantizedFormatError(f"checkpoint_format {checkpoint_format!r} is not one of {GPTQ_FORMATS}")
    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise PrequantizedFormatError("qweight, qzeros and scales must be 2-D")
    per_word = WORD_BITS // bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = 1 if group_size == -1 else -(-k // group_size)
    _expect_shape("scales", scales, (groups, n), bits, group_size)
    _expect_shape("qzeros", qzeros, (groups, n // per_word), bits, group_size)
    if not scales.is_floating_point() or n % per_word:
        raise PrequantizedFormatError(f"scales must be float and N={n} a multiple of {per_word}")
    g_idx = default_g_idx(k, group_size) if g_idx is None else _checked_g_idx(g_idx, k, groups)
    zeros = unpack_words(qzeros, bits, dim=1) + (1 if checkpoint_format == "gptq" else 0)
    codes = unpack_words(qweight, bits, dim=0)
    return IntegerWeight(codes.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous(), g_idx, bits)


def _expect_shape(name: str, tensor: Tensor, shape: tuple[int, int], bits: int, group_size: int) -> None:
    if tuple(tensor.shape) != shape:
        raise PrequantizedFormatError(
            f"{name} has shape {tuple(tensor.shape)}, expected {shape} for bits={bits}, group_size={group_size} "
            "and the qweight beside it; the checkpoint does not match its quantization_config"
        )


def _checked_g_idx(g_idx: Tensor, in_features: int, groups: int) -> Tensor:
    if g_idx.shape != (in_features,) or g_idx.is_floating_point():
        raise PrequantizedFormatError(f"g_idx must be integer ({in_features},), got {g_idx.dtype} {tuple(g_idx.shape)}")
    g_idx = g_idx.to(torch.int64)
    if in_features and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise PrequantizedFormatError(f"g_idx values must lie in 0..{groups - 1}")
    return g_idx


def concat_output_shards(shards: list[IntegerWeight]) -> IntegerWeight:
    """Fuse projections of one input (q|k|v, gate|up) along N; they must share bits and g_idx."""
    first = shards[0]
    for shard in shards[1:]:
        if shard.bits != first.bits or not torch.equal(shard.g_idx, first.g_idx):
            raise PrequantizedFormatError(
                "the fused projections (e.g. q/k/v or gate/up) have different bits or g_idx; they read the "
                "same input, so flashllm needs one input order for all of them"
            )
    return IntegerWeight(*(torch.cat([getattr(s, f) for s in shards]) for f in ("codes", "zeros", "scales")),
                         first.g_idx, first.bits)


def to_quantized_weight(weight: IntegerWeight) -> QuantizedWeight:
    """IntegerWeight -> the QuantizedWeight quant_matmul multiplies by, exactly the same weight.

    4 bits: scheme "w4a16" with uint8 zero points, or none when every zero point is 8.
    8 bits: scheme "w8a16" when every zero point is 128 (symmetric); asymmetric int8 is refused.
    An act-order g_idx is sorted so each group's features are contiguous: the columns move and
    `input_perm` tells quant_matmul to gather x's features in the same order.
    Scales become fp32 (exact for fp16/bf16 checkpoints).
    """
    n, k = weight.codes.shape
    groups = weight.zeros.shape[1]
    if groups == 0 or k % groups:
        raise PrequantizedFormatError(f"{groups} groups do not split in_features {k} evenly; flashllm needs equal groups")
    group_size = -1 if groups == 1 else k // groups
    perm = torch.argsort(weight.g_idx, stable=True)
    if not torch.equal(weight.g_idx[perm], default_g_idx(k, group_size)):
        raise PrequantizedFormatError(f"g_idx must put exactly {k // groups} input features in each of the {groups} groups")
    identity = torch.equal(perm, torch.arange(k))
    codes = weight.codes if identity else weight.codes[:, perm]
    data, zeros = _scheme_data(codes, weight.zeros, weight.bits)
    scheme = "w4a16" if weight.bits == 4 else "w8a16"
    return QuantizedWeight(scheme, data, weight.scales.to(torch.float32), zeros, group_size,
                           input_perm=None if identity else perm)


def _scheme_data(codes: Tensor, zeros: Tensor, bits: int) -> tuple[Tensor, Tensor | None]:
    """(stored data, uint8 zero points or None) of codes (N, K) in the scheme for `bits`."""
    if bits == 8:
        if bool((zeros != INT8_SYMMETRIC_ZERO).any()):
            raise PrequantizedFormatError(
                "asymmetric 8-bit GPTQ (zero points other than 128) is not supported: flashllm's w8a16 is "
                "symmetric; use a sym=true 8-bit or a 4-bit checkpoint"
            )
        return (codes - INT8_SYMMETRIC_ZERO).to(torch.int8), None
    if bool((zeros < 0).any()) or bool((zeros > 15).any()):
        raise PrequantizedFormatError(
            "an int4 zero point lies outside 0..15 (a v1 'gptq' checkpoint stores 0 as 15, read back as 16); "
            "flashllm's w4a16 holds zero points 0..15: re-export the model in gptq_v2 format"
        )
    if bool((zeros == INT4_SYMMETRIC_ZERO).all()):
        return pack_int4(codes), None
    return pack_int4(codes), zeros.to(torch.uint8)
