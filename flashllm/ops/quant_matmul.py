"""quant_matmul: the linear layer for every weight format, carried by QuantizedWeight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

USES: frozenset[str] = frozenset({"quant"})

# scheme -> how many logical input features one stored column of `data` holds (packing)
_PACK_FACTOR: dict[str, int] = {"none": 1, "w8a16": 1, "w4a16": 2, "a8w8": 1, "fp8": 1}
# scheme -> the stored dtype of `data`
_DATA_DTYPE: dict[str, torch.dtype] = {
    "w8a16": torch.int8, "w4a16": torch.uint8, "a8w8": torch.int8, "fp8": torch.float8_e4m3fn,
}
SCHEMES: frozenset[str] = frozenset(_PACK_FACTOR)
# schemes that quantize the activations too (per token, at every call); the rest keep x as it is
ACTIVATION_SCHEMES: frozenset[str] = frozenset({"a8w8", "fp8"})
# schemes whose weights may carry per-group float offsets (QuantizedWeight.offsets)
AFFINE_SCHEMES: frozenset[str] = frozenset({"w8a16", "w4a16"})
# the quant capability a kernel claims (Caps.quant) when it reads offsets and runs every layout
# flashllm.quant.gguf_blocks builds: w8a16 at groups of 16 and 32, w4a16 at 32, fp16 or fp32
# scales, offsets or not; a model holding such weights asks for it instead of a scheme name
AFFINE_CAPABILITY = "gguf"
# int4 codes are stored unsigned (0..15); a symmetric weight has the implicit zero point 8
INT4_SYMMETRIC_ZERO = 8
INT8_MAX = 127  # symmetric int8 uses -127..127 so that +-max are both representable
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# a scale is never below this, so an all-zero row or token divides cleanly (its codes are all zero)
MIN_SCALE = torch.finfo(torch.float32).tiny


def _unsupported(scheme: str) -> NotImplementedError:
    return NotImplementedError(
        f"quantization scheme {scheme!r} has no reference implementation yet; "
        f"supported: {sorted(_PACK_FACTOR)} (load the model unquantized or add the scheme to ops/quant_matmul.py)"
    )


@dataclass(slots=True)
class QuantizedWeight:
    """A linear weight in some storage scheme: what quant_matmul multiplies by.

    scheme "none": data is the plain float (N, K) = (out_features, in_features) matrix.
    scheme "w8a16": data int8 (N, K), symmetric: W[n, k] = data[n, k] * scales[n, g].
    scheme "w4a16": data uint8 (N, K/2), two 4-bit codes per byte (low nibble = even k, high
      nibble = odd k), codes 0..15: W[n, k] = (code[n, k] - zero) * scales[n, g], with
      zero = zeros[n, g] (asymmetric, uint8 0..15) or 8 when zeros is None (symmetric).
    offsets: "w8a16" / "w4a16" only, float (N, num_groups) or None: a float per-group term
      (GGUF's Q4_1 minimum and the K-quants' -dmin * m). With offsets the weight is affine,
      W[n, k] = code[n, k] * scales[n, g] + offsets[n, g], with no zero point (zeros must be
      None; w4a16's implicit 8 does not apply). Kernels that do not read offsets must not claim
      the capability name AFFINE_CAPABILITY (backends list it in their quant caps when they do).
    scheme "a8w8": data int8 (N, K) in -127..127, per-channel scales (N, 1):
      W[n, k] = data[n, k] * scales[n, 0]; activations are quantized per token to int8 at
      every call (see quant_matmul).
    scheme "fp8": data float8_e4m3fn (N, K), per-channel scales (N, 1):
      W[n, k] = float(data[n, k]) * scales[n, 0]; activations are quantized per token to e4m3.
    scales: float (N, num_groups), num_groups = K / group_size, or 1 when group_size is -1
      (one scale per output channel, the only choice for "a8w8" and "fp8"); g = k // group_size.
    smooth: "a8w8" / "fp8" only, float (K,) > 0 or None: SmoothQuant factors. The stored weight
      is the original one with column k multiplied by smooth[k]; the op divides x by smooth
      before quantizing it, so the product is unchanged while activation outliers shrink.
    input_perm: int64 (K,) permutation or None (GPTQ act-order): column k of data, scales
      groups and smooth belongs to input feature input_perm[k]; every scheme multiplies
      x.index_select(-1, input_perm) instead of x.
    gguf_type: the GGML block type(s) a GGUF weight was read from ("Q8_0"; "Q5_0+Q8_0" for a fused
      layer joined from two), else None; on a float ("none") LM head, the quantized type its rows
      were dequantized from. Metadata: the arithmetic is the scheme's; llama.cpp multiplies such
      weights against activations rounded to int8 per block, so a backend may do the same for them
      (the cpu backend does by default: backends/cpu/native.int8_activations; llama.cpp's own blocks
      with FLASHLLM_CPU_GGUF_ACTIVATIONS=llama, native.llama_format).
    kernel_cache: re-layouts of `data` that one backend's kernel builds once and reuses (e.g.
      torch's CPU int4 tile layout, fbgemm's packed int8 weight); the reference never reads
      it, clones start it empty.
    """

    scheme: str
    data: Tensor
    scales: Tensor | None = None
    zeros: Tensor | None = None
    group_size: int = -1
    smooth: Tensor | None = None
    input_perm: Tensor | None = None
    offsets: Tensor | None = None
    gguf_type: str | None = None
    kernel_cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.scheme not in _PACK_FACTOR:
            raise _unsupported(self.scheme)
        if self.data.dim() != 2:
            raise ValueError(f"QuantizedWeight.data must be 2-D (N, K), got shape {tuple(self.data.shape)}")
        self._check_input_perm()
        if self.smooth is not None and self.scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"smooth (SmoothQuant factors) applies to schemes that quantize activations "
                f"({sorted(ACTIVATION_SCHEMES)}), not {self.scheme!r}; divide the weight's columns by it instead"
            )
        if self.scheme == "none":
            if not self.data.is_floating_point():
                raise ValueError(f"scheme 'none' expects a float weight, got {self.data.dtype}")
            return
        if self.scheme in ACTIVATION_SCHEMES:
            self._check_activation_scheme()
        self._check_quantized()

    def _check_input_perm(self) -> None:
        if self.input_perm is None:
            return
        k = self.in_features
        perm = self.input_perm
        if perm.dtype != torch.int64 or tuple(perm.shape) != (k,):
            raise ValueError(f"input_perm must be an int64 ({k},) permutation, got {perm.dtype} {tuple(perm.shape)}")
        if not torch.equal(perm.sort().values, torch.arange(k, device=perm.device)):
            raise ValueError(f"input_perm is not a permutation of 0..{k - 1}; the checkpoint's g_idx/perm is corrupt")

    def _check_activation_scheme(self) -> None:
        if self.group_size != -1:
            raise ValueError(f"scheme {self.scheme!r} has one scale per output channel: group_size must be -1, "
                             f"got {self.group_size}")
        if self.smooth is not None and (
            tuple(self.smooth.shape) != (self.in_features,) or not self.smooth.is_floating_point()
            or not bool((self.smooth > 0).all())
        ):
            raise ValueError(f"smooth must be a positive float ({self.in_features},) tensor, got "
                             f"{self.smooth.dtype} {tuple(self.smooth.shape)} (min {self.smooth.min().item():g})")

    def _check_quantized(self) -> None:
        want = _DATA_DTYPE[self.scheme]
        if self.data.dtype != want:
            raise ValueError(f"scheme {self.scheme!r} stores data as {want}, got {self.data.dtype}")
        k = self.in_features
        if self.group_size != -1 and (self.group_size <= 0 or k % self.group_size):
            raise ValueError(
                f"group_size {self.group_size} must be -1 (per output channel) or a positive divisor of "
                f"in_features {k}"
            )
        groups = 1 if self.group_size == -1 else k // self.group_size
        if self.scales is None or tuple(self.scales.shape) != (self.out_features, groups):
            got = None if self.scales is None else tuple(self.scales.shape)
            raise ValueError(f"scheme {self.scheme!r} needs float scales of shape {(self.out_features, groups)}, got {got}")
        if not self.scales.is_floating_point():
            raise ValueError(f"scales must be a float tensor, got {self.scales.dtype}")
        if self.offsets is not None:
            self._check_offsets(groups)
        if self.zeros is not None:
            if self.scheme != "w4a16":
                raise ValueError(f"scheme {self.scheme!r} is symmetric: zeros must be None")
            if tuple(self.zeros.shape) != (self.out_features, groups) or self.zeros.is_floating_point():
                raise ValueError(
                    f"w4a16 zeros must be integer codes of shape {(self.out_features, groups)}, got "
                    f"{self.zeros.dtype} {tuple(self.zeros.shape)}"
                )

    def _check_offsets(self, groups: int) -> None:
        if self.scheme not in AFFINE_SCHEMES:
            raise ValueError(f"offsets apply to the weight-only schemes {sorted(AFFINE_SCHEMES)}, not {self.scheme!r}")
        if self.zeros is not None:
            raise ValueError("a weight with offsets has no zero point (W = code * scale + offset): zeros must be None")
        if tuple(self.offsets.shape) != (self.out_features, groups) or not self.offsets.is_floating_point():
            raise ValueError(f"offsets must be a float ({self.out_features}, {groups}) tensor, got "
                             f"{self.offsets.dtype} {tuple(self.offsets.shape)}")

    @classmethod
    def dense(cls, weight: Tensor) -> QuantizedWeight:
        """Wrap a plain float (N, K) weight (scheme "none")."""
        return cls(scheme="none", data=weight)

    @property
    def out_features(self) -> int:
        """N, the number of output features."""
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        """K, the number of input features (stored columns times the scheme's packing)."""
        return int(self.data.shape[1]) * _PACK_FACTOR[self.scheme]

    @property
    def num_groups(self) -> int:
        """Scale groups along K: K / group_size, or 1 per output channel."""
        return 1 if self.group_size == -1 else self.in_features // self.group_size

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The stored tensors: data, then scales, zeros, smooth, input_perm, offsets where present."""
        found = (self.data, self.scales, self.zeros, self.smooth, self.input_perm, self.offsets)
        return tuple(t for t in found if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of data, scales, zeros, smooth, input_perm and offsets (kernel_cache not included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def pack_int4(codes: Tensor) -> Tensor:
    """(N, K) integer codes in 0..15 -> (N, K/2) uint8; low nibble = even column. K must be even."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 codes in 0..15; the inverse of pack_int4."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def integer_codes(weight: QuantizedWeight) -> tuple[Tensor, Tensor]:
    """(codes (N, K) int32, zero points (N, num_groups) int32) of a quantized weight.

    The dequantized weight is (codes - zero[group]) * scales[group] (+ offsets[group]) per element;
    a weight with offsets has zero points 0.
    """
    if weight.scheme in ("w8a16", "a8w8"):
        codes = weight.data.to(torch.int32)
        zero = torch.zeros(weight.out_features, weight.num_groups, dtype=torch.int32, device=codes.device)
    elif weight.scheme == "w4a16":
        codes = unpack_int4(weight.data).to(torch.int32)
        implicit = 0 if weight.offsets is not None else INT4_SYMMETRIC_ZERO
        zero = (torch.full((weight.out_features, weight.num_groups), implicit, dtype=torch.int32,
                           device=codes.device) if weight.zeros is None else weight.zeros.to(torch.int32))
    else:
        raise ValueError(f"scheme {weight.scheme!r} has no integer codes")
    return codes, zero


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (N, K) stored weight a QuantizedWeight stands for, in `dtype`.

    Quantized schemes are computed in fp32, (code - zero) * scale (fp8: float(code) * scale),
    one rounding per element, with offsets then + offset (a second rounding, a separate add as
    ggml's dequantization does, never a fused multiply-add), then cast to `dtype`; "none" is the stored weight cast to
    `dtype`. Columns stay in the stored order (input_perm is not undone) and smoothed.
    """
    if weight.scheme == "none":
        return weight.data.to(dtype)
    if weight.scheme == "fp8":
        return (weight.data.to(torch.float32) * weight.scales.to(torch.float32)).to(dtype)
    codes, zero = integer_codes(weight)
    n, k, groups = weight.out_features, weight.in_features, weight.num_groups
    shifted = (codes.view(n, groups, k // groups) - zero[:, :, None]).to(torch.float32)
    scaled = shifted * weight.scales.to(torch.float32)[:, :, None]
    if weight.offsets is not None:
        scaled = scaled + weight.offsets.to(torch.float32)[:, :, None]
    return scaled.view(n, k).to(dtype)


def quantize_activation_int8(x: Tensor, smooth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token symmetric int8 quantization of activations, the a8w8 scheme's left operand.

    x (T, K) float; smooth (K,) or None. In fp32: x' = x / smooth, scale[t] = max|x'[t]| / 127
    (at least MIN_SCALE), codes = clamp(round_half_even(x' / scale), -127, 127).
    Returns (codes (T, K) fp32 holding integers, scales (T, 1) fp32). Kernels must produce the
    same codes: the row maximum lands on +-127 exactly, which the cpu fbgemm path relies on.
    """
    xf = x.to(torch.float32)
    if smooth is not None:
        xf = xf / smooth.to(torch.float32)
    scales = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=MIN_SCALE)
    return torch.round(xf / scales).clamp(-INT8_MAX, INT8_MAX), scales


def quantize_activation_fp8(x: Tensor, smooth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token e4m3 quantization of activations, the fp8 scheme's left operand.

    x (T, K) float; smooth (K,) or None. In fp32: x' = x / smooth, scale[t] = max|x'[t]| / 448
    (at least MIN_SCALE), codes = e4m3(clamp(x' / scale, -448, 448)) rounded to nearest even.
    Returns (codes (T, K) float8_e4m3fn, scales (T, 1) fp32).
    """
    xf = x.to(torch.float32)
    if smooth is not None:
        xf = xf / smooth.to(torch.float32)
    scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=MIN_SCALE)
    codes = (xf / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def _a8w8(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """acc[t, n] = sum_k codes_x[t, k] * data[n, k] exactly, then fp32 (acc * s_x[t]) * s_w[n]."""
    codes, x_scales = quantize_activation_int8(x, weight.smooth)
    # fp64 holds every partial sum exactly (|acc| <= 127 * 127 * K < 2**53 for any real K) and
    # has a GEMM on every torch device, unlike int32/int64 matmuls; this is the int32 result.
    acc = F.linear(codes.to(torch.float64), weight.data.to(torch.float64))
    return acc.to(torch.float32) * x_scales * weight.scales.to(torch.float32).view(1, -1)


def _fp8(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """Both e4m3 operands widened to fp32, an fp32 GEMM, then (acc * s_x[t]) * s_w[n]."""
    codes, x_scales = quantize_activation_fp8(x, weight.smooth)
    acc = F.linear(codes.to(torch.float32), weight.data.to(torch.float32))
    return acc * x_scales * weight.scales.to(torch.float32).view(1, -1)


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W.T + bias, where W is the dequantized weight.

    Shapes: x (T, K) float; weight with in_features K and out_features N; bias (N,) or None;
    returns (T, N) in x.dtype. With weight.input_perm set, x.index_select(-1, input_perm)
    replaces x first, for every scheme. Scheme "none" is exactly torch.nn.functional.linear
    with the weight in x.dtype. Weight-only schemes ("w8a16", "w4a16") compute in fp32:
    F.linear(x.float(), dequantize(weight), bias.float()), rounded once to x.dtype.
    "a8w8": x (divided by smooth) quantized per token (quantize_activation_int8), the integer
    product accumulated exactly (int32 semantics), then y = fp32(acc) * s_x[t] * s_w[n] + bias
    in fp32, rounded once to x.dtype. "fp8": x quantized per token to e4m3
    (quantize_activation_fp8), acc = fp32 GEMM of both e4m3 operands widened to fp32, then
    y = acc * s_x[t] * s_w[n] + bias in fp32, rounded once to x.dtype.
    Unknown schemes raise NotImplementedError naming the scheme.
    """
    if weight.scheme not in _PACK_FACTOR:
        raise _unsupported(weight.scheme)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    xp = x if weight.input_perm is None else x.index_select(-1, weight.input_perm)
    if weight.scheme == "none":
        w = weight.data.to(x.dtype)
        return F.linear(xp, w, None if bias is None else bias.to(x.dtype))
    if weight.scheme not in ACTIVATION_SCHEMES:
        return F.linear(xp.float(), dequantize(weight), None if bias is None else bias.float()).to(x.dtype)
    out = _a8w8(xp, weight) if weight.scheme == "a8w8" else _fp8(xp, weight)
    return (out if bias is None else out + bias.float()).to(x.dtype)
