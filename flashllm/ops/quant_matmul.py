"""quant_matmul: the linear layer for every weight format, carried by QuantizedWeight."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

USES: frozenset[str] = frozenset({"quant"})

# scheme -> how many logical input features one stored column of `data` holds (packing)
_PACK_FACTOR: dict[str, int] = {"none": 1}


def _unsupported(scheme: str) -> NotImplementedError:
    return NotImplementedError(
        f"quantization scheme {scheme!r} has no reference implementation yet; "
        f"supported: {sorted(_PACK_FACTOR)} (load the model unquantized or add the scheme to ops/quant_matmul.py)"
    )


@dataclass(slots=True)
class QuantizedWeight:
    """A linear weight in some storage scheme: what quant_matmul multiplies by.

    scheme: "none" for a plain float weight (more schemes land with their reference body).
    data: the stored weight; for "none" the (N, K) = (out_features, in_features) float matrix.
    scales / zeros: per-channel or per-group dequantization parameters (None for "none").
    group_size: input features sharing one scale/zero; -1 means per output channel.
    """

    scheme: str
    data: Tensor
    scales: Tensor | None = None
    zeros: Tensor | None = None
    group_size: int = -1

    def __post_init__(self) -> None:
        if self.scheme not in _PACK_FACTOR:
            raise _unsupported(self.scheme)
        if self.data.dim() != 2:
            raise ValueError(f"QuantizedWeight.data must be 2-D (N, K), got shape {tuple(self.data.shape)}")
        if self.scheme == "none" and not self.data.is_floating_point():
            raise ValueError(f"scheme 'none' expects a float weight, got {self.data.dtype}")

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


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W.T + bias, where W is the dequantized weight.

    Shapes: x (T, K) float; weight with in_features K and out_features N; bias (N,) or None;
    returns (T, N) in x.dtype. Scheme "none" is exactly torch.nn.functional.linear with the
    weight in x.dtype. Unknown schemes raise NotImplementedError naming the scheme.
    """
    if weight.scheme not in _PACK_FACTOR:
        raise _unsupported(weight.scheme)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    w = weight.data.to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
