"""Which activations the cpu backend's integer kernels (native.py) meet: the environment switches for int8
activations, prompt terms and llama.cpp's rounding of GGUF weights, and the fp32 oracle of that rounding."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from flashllm.ops.quant_matmul import QuantizedWeight

GROUP_MULTIPLE = 32  # the integer kernels step 32 input features at a time
# int4 weights meet int8 activations (csrc/int4_int8_kernels.c) unless this says "fp32"; the
# activations are quantized per block of A8_BLOCK features, so groups must be multiples of it
INT4_ACTIVATIONS_ENV = "FLASHLLM_CPU_INT4_ACTIVATIONS"
# int8 weights meet int8 activations the same way only when this says "int8" (opt-in: the exact
# fp32 kernel is the default for flashllm's own w8a16, whose users chose int8 for its fidelity;
# GGUF weights default to int8 activations, as llama.cpp runs them)
W8_ACTIVATIONS_ENV = "FLASHLLM_CPU_W8_ACTIVATIONS"
A8_BLOCK = 64

# Prompts (more than MAX_TOKENS rows) of int8/int4 weights other than per-channel w8a16 on AVX-512F
# (see F32_PROMPT_MAX_TOKENS) dequantize for a BLAS GEMM by default
# ("fp32": exact; docs/gguf.md says why one int8 term is not the default). Opt-in, the same integer kernels as
# decode (prompt_linear) against activations in two int8 terms per block ("int8x2": x to within
# absmax / 64516 of the block, about 16 bits) or one ("int8": llama.cpp's rounding, which flips close
# calls: SmolLM2's quick-start answer). Int8 codes on VNNI run 4-row x 4-token tiles (w8_tiles): "int8"
# 201 tokens/s on the Q8_0 file against fp32's 151 and llama.cpp's 256 (docs/benchmarks.md).
PROMPT_ACTIVATIONS_ENV = "FLASHLLM_CPU_PROMPT_ACTIVATIONS"
PROMPT_TERMS = {"int8x2": 2, "int8": 1, "fp32": 0}
# How activations meeting GGUF weights are rounded: "block64" (the default) flashllm's own (one fp32
# scale per 64 features in decode, exact prompts and LM head); "llama" as llama.cpp's CPU backend rounds
# them (q8_0 / q8_1 blocks of 32 features with fp16 scales, q8_K blocks of 256 for the K-quants;
# flashllm/quant/gguf_activations.py) in decode, prompts and the LM head alike: each product then equals
# llama.cpp's up to the fp32 order of its sums. Why not the default: it does not make greedy tokens
# follow llama.cpp's more often. Rounding to int8 is discontinuous, so a 1-ulp difference anywhere
# before it (norms, rotary, softmax) flips codes, and over 30 layers SmolLM2's logprobs move by
# 0.13-0.25 either way, as far as from exact activations (docs/gguf.md).
GGUF_ACTIVATIONS_ENV = "FLASHLLM_CPU_GGUF_ACTIVATIONS"
GGUF_MODES = ("block64", "llama")
# csrc/int4_int8_kernels.c's A8_* formats
A8_FORMATS = {None: 0, "q8_0": 1, "q8_1": 2, "q8_K": 3}

def _int8_layout(weight: QuantizedWeight) -> bool:
    """Whether csrc/int4_int8_kernels.c runs this weight's layout: K whole A8_BLOCKs, groups of 32
    features (int4 or int8), 16 (int8) or a multiple of A8_BLOCK."""
    group = weight.in_features // weight.num_groups
    fine = (32,) if weight.scheme == "w4a16" else (16, 32)
    return weight.in_features % A8_BLOCK == 0 and (group in fine or group % A8_BLOCK == 0)


def int8_activations(weight: QuantizedWeight) -> bool:
    """Whether this weight's native products quantize the activations to int8 in blocks of
    A8_BLOCK features: w4a16 by default (FLASHLLM_CPU_INT4_ACTIVATIONS=fp32 turns it off); w8a16
    with FLASHLLM_CPU_W8_ACTIVATIONS=int8, and by default for weights read from GGUF files (gguf_type
    set: llama.cpp runs Q8_0/Q5_0 against int8 activations too) and the layouts only GGUF files bring
    (offsets or groups of 16, which the exact fp32 kernel does not run; =fp32 sends those to the
    exact dequantize path); either needs a layout _int8_layout accepts."""
    gguf_only = (weight.gguf_type is not None or weight.offsets is not None
                 or (weight.in_features // weight.num_groups) % GROUP_MULTIPLE != 0)
    env, default = {"w4a16": (INT4_ACTIVATIONS_ENV, "int8"),
                    "w8a16": (W8_ACTIVATIONS_ENV, "int8" if gguf_only else "fp32")}.get(weight.scheme, (None, "fp32"))
    mode = os.environ.get(env, default) if env else default
    if mode not in ("int8", "fp32"):
        raise ValueError(f"{env} must be int8 or fp32, got {mode!r}")
    return mode == "int8" and _int8_layout(weight)



def gguf_mode() -> str:
    """FLASHLLM_CPU_GGUF_ACTIVATIONS: "block64" (default) or "llama" (see GGUF_MODES' comment)."""
    mode = os.environ.get(GGUF_ACTIVATIONS_ENV, "block64")
    if mode not in GGUF_MODES:
        raise ValueError(f"{GGUF_ACTIVATIONS_ENV} must be one of {', '.join(GGUF_MODES)}, got {mode!r}")
    return mode


def llama_format(weight: QuantizedWeight) -> str | None:
    """The llama.cpp activation format ("q8_0", "q8_1", "q8_K") this weight's products round to:
    a GGUF weight's in the opt-in "llama" mode, else None (flashllm's own rounding, or none, as with
    FLASHLLM_CPU_INT4_ACTIVATIONS / FLASHLLM_CPU_W8_ACTIVATIONS=fp32 for the weight's scheme)."""
    if weight.gguf_type is None or gguf_mode() != "llama":
        return None
    env = INT4_ACTIVATIONS_ENV if weight.scheme == "w4a16" else W8_ACTIVATIONS_ENV
    if os.environ.get(env) == "fp32":
        return None
    from flashllm.quant.gguf_activations import format_of

    return format_of(weight.gguf_type)



def _int8_terms(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 blocks (..., A8_BLOCK) -> (codes, scales, remainder) in fp32 as the kernels compute them:
    scale absmax / 127, codes round-half-even(x * (127 / absmax)), remainder x - code * scale rounded
    once (the kernels' fused multiply-add; in float64 the product and difference are exact)."""
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes, scales = torch.round(blocks * inverse), amax / 127.0
    return codes, scales, (blocks.double() - codes.double() * scales.double()).float()


def int8_rounded(x: Tensor, terms: int = 1) -> Tensor:
    """x (T, K) as the integer x int8 kernels see it, in x's dtype: per token and block of A8_BLOCK
    features, round-half-even(x * (127 / absmax)) in fp32 times absmax / 127; with terms=2 plus the
    remainder x - that, rounded the same way (prompt_linear's default; tests and docs use it to state
    the kernels' one approximation)."""
    tokens, k = x.shape
    blocks = x.float().reshape(tokens, k // A8_BLOCK, A8_BLOCK)
    codes, scales, remainder = _int8_terms(blocks)
    out = codes.double() * scales.double()
    if terms == 2:
        codes2, scales2, _ = _int8_terms(remainder)
        out = out + codes2.double() * scales2.double()
    return out.reshape(tokens, k).to(x.dtype)


def prompt_terms(weight: QuantizedWeight) -> int:
    """Activation terms prompt_linear uses for this weight: 2 or 1 (FLASHLLM_CPU_PROMPT_ACTIVATIONS
    int8x2 or int8), 0 where prompts dequantize for a GEMM instead (=fp32, the default, or a layout
    the integer kernels do not run)."""
    mode = os.environ.get(PROMPT_ACTIVATIONS_ENV, "fp32")
    if mode not in PROMPT_TERMS:
        raise ValueError(f"{PROMPT_ACTIVATIONS_ENV} must be one of {sorted(PROMPT_TERMS)}, got {mode!r}")
    if weight.scheme not in ("w8a16", "w4a16") or not _int8_layout(weight):
        return 0
    return PROMPT_TERMS[mode]
