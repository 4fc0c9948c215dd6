"""User quant_type spellings (PaddleNLP flags and plain aliases) -> the scheme the layers quantize to."""

from __future__ import annotations

from dataclasses import dataclass

# quant_type -> (scheme, symmetric). PaddleNLP spells weight-only as weight_only_int8/int4.
WEIGHT_ONLY_TYPES: dict[str, tuple[str, bool]] = {
    "none": ("none", True),
    "weight_only_int8": ("w8a16", True),
    "w8a16": ("w8a16", True),
    "weight_only_int4": ("w4a16", True),
    "w4a16": ("w4a16", True),
    "weight_only_int4_asym": ("w4a16", False),
    "w4a16_asym": ("w4a16", False),
}
# Spellings the issue names that later slices implement; refused with a pointer, not as unknown.
NOT_YET: dict[str, str] = {
    "a8w8": "A8W8 (SmoothQuant)", "w8a8": "A8W8 (SmoothQuant)",
    "a8w8_fp8": "FP8", "fp8": "FP8",
}
# torch's CPU int4 kernel and most GPU int4 kernels take these group sizes
COMMON_GROUP_SIZES = (32, 64, 128)


class QuantConfigError(ValueError):
    """A quant_type / group size the engine cannot load with; the message lists the choices."""


@dataclass(frozen=True, slots=True)
class WeightQuantSpec:
    """How the linear layers store their weights after loading.

    scheme: "none" | "w8a16" | "w4a16" (the capability-matrix key the op table is resolved for).
    group_size: input features sharing one scale, -1 for one scale per output channel.
    symmetric: int4 only: False adds a per-group zero point (asymmetric range).
    """

    scheme: str = "none"
    group_size: int = -1
    symmetric: bool = True

    @property
    def enabled(self) -> bool:
        """Whether weights are quantized at all."""
        return self.scheme != "none"


def weight_quant_spec(quant_type: str = "none", group_size: int = -1) -> WeightQuantSpec:
    """Parse `--quant_type` and `--weightonly_group_size` into a WeightQuantSpec.

    quant_type: none | weight_only_int8 (w8a16) | weight_only_int4 (w4a16) |
    weight_only_int4_asym (w4a16_asym). group_size: -1 (per output channel) or a positive
    group of input features (32, 64, 128 are the common ones; it must divide every layer's
    input size, which the layers check when they quantize).
    """
    key = quant_type.strip().lower()
    if key in NOT_YET:
        raise QuantConfigError(
            f"quant_type {quant_type!r} ({NOT_YET[key]}) is not implemented yet; weight-only schemes are: "
            f"{', '.join(WEIGHT_ONLY_TYPES)}"
        )
    if key not in WEIGHT_ONLY_TYPES:
        raise QuantConfigError(f"unknown quant_type {quant_type!r}; choose one of: {', '.join(WEIGHT_ONLY_TYPES)}")
    if group_size != -1 and group_size < 2:
        raise QuantConfigError(
            f"weightonly_group_size {group_size} must be -1 (per output channel) or a group of input features, "
            f"e.g. {', '.join(map(str, COMMON_GROUP_SIZES))}"
        )
    scheme, symmetric = WEIGHT_ONLY_TYPES[key]
    if scheme == "none":
        return WeightQuantSpec()
    return WeightQuantSpec(scheme, group_size, symmetric)
