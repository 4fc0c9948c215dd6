"""quant_matmul: the linear layer for every weight format, carried by QuantizedWeight."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

USES: frozenset[str] = frozenset({"quant"})

# scheme -> how many logical input features one stored column of `data` holds (packing)
_PACK_FACTOR: dict[str, int] = {"none": 1, "w8a16": 1, "w4a16": 2}
# scheme -> the stored dtype of `data`
_DATA_DTYPE: dict[str, torch.dtype] = {"w8a16": torch.int8, "w4a16": torch.uint8}
# int4 codes are stored unsigned (0..15); a symmetric weight has the implicit zero point 8
INT4_SYMMETRIC_ZERO = 8


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
    scales: float (N, num_groups), num_groups = K / group_size, or 1 when group_size is -1
      (one scale per output channel); g = k // group_size.
    kernel_cache: re-layouts of `data` that one backend's kernel builds once and reuses (e.g.
      torch's CPU int4 tile layout); the reference never reads it, clones start it empty.
    """

    scheme: str
    data: Tensor
    scales: Tensor | None = None
    zeros: Tensor | None = None
    group_size: int = -1
    kernel_cache: dict[str, Tensor] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.scheme not in _PACK_FACTOR:
            raise _unsupported(self.scheme)
        if self.data.dim() != 2:
            raise ValueError(f"QuantizedWeight.data must be 2-D (N, K), got shape {tuple(self.data.shape)}")
        if self.scheme == "none":
            if not self.data.is_floating_point():
                raise ValueError(f"scheme 'none' expects a float weight, got {self.data.dtype}")
            return
        self._check_quantized()

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
        if self.zeros is not None:
            if self.scheme != "w4a16":
                raise ValueError(f"scheme {self.scheme!r} is symmetric: zeros must be None")
            if tuple(self.zeros.shape) != (self.out_features, groups) or self.zeros.is_floating_point():
                raise ValueError(
                    f"w4a16 zeros must be integer codes of shape {(self.out_features, groups)}, got "
                    f"{self.zeros.dtype} {tuple(self.zeros.shape)}"
                )

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
    def nbytes(self) -> int:
        """Bytes of data, scales and zeros (kernel_cache not included)."""
        tensors = (self.data, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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

    The dequantized weight is (codes - zero[group]) * scales[group] per element.
    """
    if weight.scheme == "w8a16":
        codes = weight.data.to(torch.int32)
        zero = torch.zeros(weight.out_features, weight.num_groups, dtype=torch.int32, device=codes.device)
    elif weight.scheme == "w4a16":
        codes = unpack_int4(weight.data).to(torch.int32)
        zero = (torch.full((weight.out_features, weight.num_groups), INT4_SYMMETRIC_ZERO, dtype=torch.int32,
                           device=codes.device) if weight.zeros is None else weight.zeros.to(torch.int32))
    else:
        raise ValueError(f"scheme {weight.scheme!r} has no integer codes")
    return codes, zero


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (N, K) weight a QuantizedWeight stands for, in `dtype`.

    Quantized schemes are computed in fp32, (code - zero) * scale, one rounding per element,
    then cast to `dtype`; "none" is the stored weight cast to `dtype`.
    """
    if weight.scheme == "none":
        return weight.data.to(dtype)
    codes, zero = integer_codes(weight)
    n, k, groups = weight.out_features, weight.in_features, weight.num_groups
    shifted = (codes.view(n, groups, k // groups) - zero[:, :, None]).to(torch.float32)
    return (shifted * weight.scales.to(torch.float32)[:, :, None]).view(n, k).to(dtype)


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W.T + bias, where W is the dequantized weight.

    Shapes: x (T, K) float; weight with in_features K and out_features N; bias (N,) or None;
    returns (T, N) in x.dtype. Scheme "none" is exactly torch.nn.functional.linear with the
    weight in x.dtype. Quantized schemes ("w8a16", "w4a16") compute in fp32:
    F.linear(x.float(), dequantize(weight), bias.float()), rounded once to x.dtype.
    Unknown schemes raise NotImplementedError naming the scheme.
    """
    if weight.scheme not in _PACK_FACTOR:
        raise _unsupported(weight.scheme)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    if weight.scheme == "none":
        w = weight.data.to(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    out = F.linear(x.float(), dequantize(weight), None if bias is None else bias.float())
    return out.to(x.dtype)
