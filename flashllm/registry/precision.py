"""Precisions users choose, and what a device generation can run of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """What one device (or device generation) can run, independent of any kernel.

    name:        a row label, e.g. "Hopper (sm90)" or "x86 CPU (AVX2)".
    dtypes:      activation dtypes the hardware runs (at all; speed notes go in `notes`).
    quant:       quantization schemes the hardware supports (e.g. "fp8" needs sm89+).
    kv_dtypes:   KV-cache storage dtypes beyond the activation dtypes.
    native_bf16: bf16 runs at full speed (on CPUs: AVX512-BF16 or AMX).
    accelerator: a GPU-like device where `--dtype auto` keeps the checkpoint's half dtype; on a
                 host CPU `auto` computes in fp32 unless bf16 is native.
    """

    name: str
    dtypes: frozenset[torch.dtype]
    quant: frozenset[str] = frozenset({"none"})
    kv_dtypes: frozenset[torch.dtype] = frozenset()
    native_bf16: bool = True
    notes: str = ""
    accelerator: bool = True


@dataclass(frozen=True, slots=True)
class Precision:
    """One column of the capability matrix: a user-facing precision choice."""

    key: str
    label: str
    dtype: torch.dtype | None  # activation dtype; None = the profile's preferred half dtype
    quant: str = "none"
    kv_dtype: torch.dtype | None = None


PRECISIONS: tuple[Precision, ...] = (
    Precision("fp32", "FP32", torch.float32),
    Precision("fp16", "FP16", torch.float16),
    Precision("bf16", "BF16", torch.bfloat16),
    Precision("w8a16", "INT8 weight-only", None, quant="w8a16"),
    Precision("w4a16", "INT4 weight-only", None, quant="w4a16"),
    Precision("a8w8", "A8W8", None, quant="a8w8"),
    Precision("fp8", "FP8", None, quant="fp8"),
    # GGUF files' quantized tensors as they are stored (Q8_0 Q4_0 Q4_1 Q4_K Q5_K Q6_K; flashllm.quant.gguf_blocks);
    # activations stay float (the cpu kernels may round them to int8 per block, as llama.cpp does)
    Precision("gguf", "GGUF blocks", None, quant="gguf"),
    Precision("kv_int8", "INT8 KV cache", None, kv_dtype=torch.int8),
)

# What a scheme needs from the hardware, appended to the error of a device without it.
QUANT_REQUIREMENTS: dict[str, str] = {
    "fp8": "fp8 (e4m3) matmuls need an NVIDIA Ada (sm89) or Hopper (sm90) GPU or newer; elsewhere use "
           "--quant_type a8w8, or load an fp8 checkpoint with --quant_type none to dequantize it",
    "a8w8": "int8 matmuls need an NVIDIA Turing (sm75) GPU or newer, a ROCm GPU, or an x86/Arm CPU",
    "gguf": "GGUF's quantized tensors run on CPUs (the cpu backend's kernels, the reference elsewhere); no GPU "
            "backend claims them yet: run the file on --device cpu",
}

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}


def parse_dtype(name: str) -> torch.dtype:
    """Map a user dtype string ("bfloat16", "bf16", "float32", ...) to a torch dtype."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)} (or auto)")
    return DTYPE_NAMES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16, and so on."""
    return str(dtype).removeprefix("torch.")


def activation_dtype(precision: Precision, profile: DeviceProfile) -> torch.dtype:
    """The activation dtype a precision runs with on a device: fp16 or bf16 where unspecified."""
    if precision.dtype is not None:
        return precision.dtype
    for candidate in (torch.bfloat16, torch.float16, torch.float32):
        if candidate in profile.dtypes and (candidate != torch.bfloat16 or profile.native_bf16):
            return candidate
    return torch.float32


def device_supports(precision: Precision, profile: DeviceProfile) -> str | None:
    """Why the device cannot run `precision`, or None when its hardware can."""
    if precision.dtype is not None and precision.dtype not in profile.dtypes:
        return f"{profile.name} has no {dtype_name(precision.dtype)}"
    if precision.quant not in profile.quant:
        return f"{profile.name} has no {precision.quant}"
    if precision.kv_dtype is not None and precision.kv_dtype not in profile.kv_dtypes:
        return f"{profile.name} has no {dtype_name(precision.kv_dtype)} KV cache"
    return None


def quant_requirement(scheme: str) -> str:
    """A sentence naming the devices that run `scheme` ("" when every device does)."""
    return QUANT_REQUIREMENTS.get(scheme, "")
