"""User quant_type spellings (PaddleNLP flags and plain aliases) -> the scheme the layers quantize to.

Pre-quantized checkpoints. A linear layer `<prefix>` (e.g. `model.layers.0.mlp.down_proj`)
whose checkpoint holds, instead of a float `<prefix>.weight`:

    <prefix>.weight         int8 (N, K) codes in -127..127  -> scheme "a8w8"
                            float8_e4m3fn (N, K)            -> scheme "fp8"
    <prefix>.weight_scale   float (N, 1): W[n, k] = weight[n, k] * weight_scale[n]
    <prefix>.smooth_factor  float (K,), optional: SmoothQuant factors the weight's columns were
                            multiplied by (x is divided by them before quantization)

loads without requantizing when `--quant_type` names the same scheme. A float weight may also
carry `<prefix>.smooth_factor` alone (a smoothed float checkpoint): a8w8/fp8 quantize it and keep
the factors, other schemes divide them back out. Fused projections (q/k/v, gate/up) read one
input, so their shards must carry identical smooth factors. A pre-quantized weight loaded with
another quant_type is dequantized (and unsmoothed) first, so e.g. `none` runs an fp8 checkpoint
in the model dtype on a device without fp8. This is the layout the `flashllm quantize` tool
writes; GPTQ/AWQ imports have their own names.
"""

from __future__ import annotations

from dataclasses import dataclass

# quant_type -> (scheme, symmetric). PaddleNLP spells weight-only as weight_only_int8/int4 and
# SmoothQuant as a8w8; FP8 as a8w8_fp8.
WEIGHT_ONLY_TYPES: dict[str, tuple[str, bool]] = {
    "none": ("none", True),
    "weight_only_int8": ("w8a16", True),
    "w8a16": ("w8a16", True),
    "weight_only_int4": ("w4a16", True),
    "w4a16": ("w4a16", True),
    "weight_only_int4_asym": ("w4a16", False),
    "w4a16_asym": ("w4a16", False),
}
ACTIVATION_TYPES: dict[str, tuple[str, bool]] = {
    "a8w8": ("a8w8", True),
    "w8a8": ("a8w8", True),
    "smoothquant": ("a8w8", True),
    "a8w8_fp8": ("fp8", True),
    "fp8": ("fp8", True),
}
QUANT_TYPES: dict[str, tuple[str, bool]] = {**WEIGHT_ONLY_TYPES, **ACTIVATION_TYPES}
# checkpoint tensor suffixes of a pre-quantized linear layer, beside `<prefix>.weight`
WEIGHT_SCALE_SUFFIX = "weight_scale"
SMOOTH_FACTOR_SUFFIX = "smooth_factor"
# torch's CPU int4 kernel and most GPU int4 kernels take these group sizes
COMMON_GROUP_SIZES = (32, 64, 128)
# the linear schemes beside which --quantize_lm_head may store the head as int8
LM_HEAD_SCHEMES = frozenset({"w8a16", "w4a16"})


class QuantConfigError(ValueError):
    """A quant_type / group size the engine cannot load with; the message lists the choices."""


@dataclass(frozen=True, slots=True)
class WeightQuantSpec:
    """How the linear layers store their weights after loading.

    scheme: "none" | "w8a16" | "w4a16" | "a8w8" | "fp8" (the capability-matrix key the op table
      is resolved for).
    group_size: input features sharing one scale, -1 for one scale per output channel.
    symmetric: int4 only: False adds a per-group zero point (asymmetric range).
    lm_head: also store the LM head (tied or not) as per-channel int8 (w8a16), whatever the
      linear layers' weight-only scheme; int8 rather than int4 because the logits feel every
      error of the head directly, as llama.cpp keeps its output tensor at higher precision.
      A tied embedding keeps its float table for lookups beside the int8 head.
    """

    scheme: str = "none"
    group_size: int = -1
    symmetric: bool = True
    lm_head: bool = False

    @property
    def enabled(self) -> bool:
        """Whether weights are quantized at all."""
        return self.scheme != "none"


def weight_quant_spec(quant_type: str = "none", group_size: int = -1, lm_head: bool = False) -> WeightQuantSpec:
    """Parse `--quant_type` and `--weightonly_group_size` into a WeightQuantSpec.

    quant_type: none | weight_only_int8 (w8a16) | weight_only_int4 (w4a16) |
    weight_only_int4_asym (w4a16_asym) | a8w8 (w8a8, smoothquant) | a8w8_fp8 (fp8).
    group_size: -1 (per output channel) or a positive group of input features (32, 64, 128 are
    the common ones; it must divide every layer's input size, which the layers check when they
    quantize); a8w8 and fp8 take -1 only.
    """
    key = quant_type.strip().lower()
    if key not in QUANT_TYPES:
        raise QuantConfigError(f"unknown quant_type {quant_type!r}; choose one of: {', '.join(QUANT_TYPES)}")
    scheme, symmetric = QUANT_TYPES[key]
    if key in ACTIVATION_TYPES and group_size != -1:
        raise QuantConfigError(f"quant_type {quant_type!r} has one weight scale per output channel; "
                               f"drop --weightonly_group_size {group_size} (or pass -1)")
    if group_size != -1 and group_size < 2:
        raise QuantConfigError(
            f"weightonly_group_size {group_size} must be -1 (per output channel) or a group of input features, "
            f"e.g. {', '.join(map(str, COMMON_GROUP_SIZES))}"
        )
    if lm_head and scheme not in LM_HEAD_SCHEMES:
        raise QuantConfigError(f"--quantize_lm_head stores the head as int8 beside weight-only int8/int4 linears; "
                               f"quant_type {quant_type!r} is not weight-only (use weight_only_int8 or weight_only_int4)")
    if scheme == "none":
        return WeightQuantSpec()
    return WeightQuantSpec(scheme, group_size, symmetric, lm_head)
