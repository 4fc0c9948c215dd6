"""Quantization: weight-only int8/int4, SmoothQuant A8W8 and FP8 at load time (KV-cache and GPTQ/AWQ land later)."""

from __future__ import annotations

from flashllm.quant.spec import QuantConfigError, WeightQuantSpec, weight_quant_spec
from flashllm.quant.weight_only import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    quantize_weight,
    unpack_int4,
)

__all__ = [
    "QuantConfigError",
    "QuantizedWeight",
    "WeightQuantSpec",
    "dequantize",
    "pack_int4",
    "quantize_weight",
    "unpack_int4",
    "weight_quant_spec",
]
