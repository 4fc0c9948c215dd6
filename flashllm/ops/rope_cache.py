"""RoPE frequency tables: inverse frequencies per rope type and the [cos | sin] cache the op reads."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(rotary_dim: int, base: float) -> Tensor:
    """(rotary_dim/2,) fp32: base ** (-2i / rotary_dim), the unscaled RoPE frequencies."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _require(scaling: dict[str, Any], key: str, rope_type: str) -> Any:
    if scaling.get(key) is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {key!r}; got keys {sorted(scaling)}")
    return scaling[key]


def _original_max(scaling: dict[str, Any], max_position: int | None, rope_type: str) -> int:
    """original_max_position_embeddings, defaulting (as transformers does) to the model's length."""
    value = scaling.get("original_max_position_embeddings") or max_position
    if value is None:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} needs 'original_max_position_embeddings' "
            "or a max_position to default it to"
        )
    return int(value)


def _default(dim: int, base: float, scaling: dict[str, Any], max_position: int | None) -> tuple[Tensor, float]:
    return _base_inv_freq(dim, base), 1.0


def _linear(dim: int, base: float, scaling: dict[str, Any], max_position: int | None) -> tuple[Tensor, float]:
    # dividing every frequency by the factor equals dividing every position by it
    factor = float(_require(scaling, "factor", "linear"))
    return _base_inv_freq(dim, base) / factor, 1.0


def _dynamic(dim: int, base: float, scaling: dict[str, Any], max_position: int | None) -> tuple[Tensor, float]:
    # transformers recomputes the base every forward from the current sequence length; a static
    # cache cannot, so we fix the length at the cache size L. Positions short of the original
    # length therefore see the scaled base too (transformers would use the unscaled one there).
    factor = float(_require(scaling, "factor", "dynamic"))
    original = _original_max(scaling, max_position, "dynamic")
    length = max(max_position or original, original)
    ntk_base = base * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(dim, ntk_base), 1.0


def _llama3(dim: int, base: float, scaling: dict[str, Any], max_position: int | None) -> tuple[Tensor, float]:
    factor = float(_require(scaling, "factor", "llama3"))
    low_freq_factor = float(_require(scaling, "low_freq_factor", "llama3"))
    high_freq_factor = float(_require(scaling, "high_freq_factor", "llama3"))
    original = _original_max(scaling, max_position, "llama3")
    inv_freq = _base_inv_freq(dim, base)
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and the
    # band between is blended linearly in original / wavelen
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_low = wavelen > original / low_freq_factor
    is_high = wavelen < original / high_freq_factor
    scaled = torch.where(is_low, inv_freq / factor, torch.where(is_high, inv_freq, blended))
    return scaled, 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn(dim: int, base: float, scaling: dict[str, Any], max_position: int | None) -> tuple[Tensor, float]:
    original = _original_max(scaling, max_position, "yarn")
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else _require_ratio(max_position, original)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_for_rotations(num_rotations: float) -> float:
        # the feature index whose wavelength fits `num_rotations` times into the original length
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keep the ramp finite
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0.0, 1.0)
    inv_freq = _base_inv_freq(dim, base)
    # ramp 0: high frequencies kept as trained (extrapolate); ramp 1: low ones interpolated
    scaled = inv_freq * (1 - ramp) + (inv_freq / factor) * ramp
    return scaled, _yarn_attention_factor(scaling, factor)


def _require_ratio(max_position: int | None, original: int) -> float:
    if max_position is None:
        raise ValueError("rope_scaling of type 'yarn' without 'factor' needs max_position to derive it")
    return max_position / original


_ROPE_TYPES: dict[str, Callable[..., tuple[Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def longrope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any], max_position: int,
                      long: bool) -> tuple[Tensor, float]:
    """LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini): the inverse frequencies of one of its two factor sets.

    rope_scaling: {"short_factor": [...], "long_factor": [...] (rotary_dim/2 divisors each),
    "original_max_position_embeddings": the training length, optional "factor" (default
    max_position / original) and "attention_factor" (default sqrt(1 + ln(factor) / ln(original)),
    1 when factor <= 1)}; max_position: the model's max_position_embeddings. long: the long set
    (transformers uses it while the sequence is longer than the original length), else the short one.
    Returns (inv_freq (rotary_dim/2,) fp32, attention_factor), as transformers'
    _compute_longrope_parameters. Not a rope type of rope_inv_freq: which set a token uses depends on
    its sequence, which one table cannot say (models/phi3.py keeps both and picks per token).
    """
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    original = int(_require(rope_scaling, "original_max_position_embeddings", "longrope"))
    key = "long_factor" if long else "short_factor"
    divisors = _require(rope_scaling, key, "longrope")
    if (not isinstance(divisors, list) or len(divisors) != rotary_dim // 2
            or not all(isinstance(d, int | float) and not isinstance(d, bool) and d > 0 for d in divisors)):
        raise ValueError(f"longrope {key} must be a list of rotary_dim / 2 = {rotary_dim // 2} positive numbers, "
                         f"got {divisors!r:.80}")
    factor = rope_scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    # 1 / (divisor * base ** e), transformers' order of operations
    inv_freq = 1.0 / (torch.tensor(divisors, dtype=torch.float32) * base**exponents)
    return inv_freq, float(attention_factor)


def cos_sin_rows(inv_freq: Tensor, attention_factor: float, num_positions: int) -> Tensor:
    """(num_positions, rotary_dim) fp32 [cos | sin] of positions 0.. num_positions - 1, times attention_factor."""
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """The rope type named by an HF rope_scaling / rope_parameters dict ("rope_type" or legacy "type")."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def rope_inv_freq(
    rotary_dim: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    max_position: int | None = None,
) -> tuple[Tensor, float]:
    """Inverse frequencies and attention factor of one rope configuration.

    rotary_dim: the rotated features per head (head_size * partial_rotary_factor), even.
    base: rope_theta. rope_scaling: HF's `rope_scaling` / `rope_parameters` dict or None.
    max_position: the length the cache will cover; it defaults `original_max_position_embeddings`
    where the dict omits it (as transformers does) and is the length "dynamic" is fixed for.
    Returns (inv_freq (rotary_dim/2,) fp32, attention_factor); the factor scales cos and sin.
    """
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    rope_type = rope_type_of(rope_scaling)
    compute = _ROPE_TYPES.get(rope_type)
    if compute is None:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return compute(rotary_dim, float(base), dict(rope_scaling or {}), max_position)


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The table `rotary_embedding` reads: (max_position, rotary_dim) as [cos | sin].

    Row p holds cos(p * inv_freq) in its first rotary_dim/2 columns and sin(p * inv_freq) in the
    last rotary_dim/2, both multiplied by the rope type's attention factor (YaRN's mscale).
    Angles are computed in fp32 and the table is returned in `dtype` (fp32 is what the op expects).
    """
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, rope_scaling, max_position)
    return cos_sin_rows(inv_freq, attention_factor, max_position).to(dtype)
