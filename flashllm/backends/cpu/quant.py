"""cpu quant_matmul: native AVX2 kernels for decode batches, torch's packed int8/int4 kernels where
torch vectorizes them, else chunked dequantize + GEMM.

Decode batches (<= native.MAX_TOKENS tokens) of w8a16/w4a16 weights whose groups are a multiple
of 32 features run the native kernels of csrc/decode_kernels.c when they build here (native.py):
0.19 / 0.15 ms per 4864 x 896 product with two threads against 0.53 ms for the native fp32 one
(`epyc3-2c`, docs/benchmarks.md).
w4a16 weights with groups of a multiple of 64 features run csrc/int4_int8_kernels.c instead, which
rounds the activations to int8 first (`rounded_inputs` says how; FLASHLLM_CPU_INT4_ACTIVATIONS=fp32
turns it off); w8a16 weights do the same only with FLASHLLM_CPU_W8_ACTIVATIONS=int8.
What follows is the choice where they do not.

On `epyc3-2c` (AVX2; one thread, N=4864 K=896): fp32 GEMV 0.8 ms, `_weight_int8pack_mm` 4.2 ms,
`_weight_int4pack_mm_for_cpu` 8.6 ms, both growing linearly with the token count (scalar code:
torch has vectorized bodies for them only under CPU_CAPABILITY_AVX512), while dequantizing
1-4 MB row chunks and running the BLAS GEMM on each takes 0.9-1.0 ms and scales like a GEMM. So
the packed kernels run only where torch reports AVX512 and the batch is a few decode tokens (a
rule read from torch's source, with no AVX512 timing behind it); every other call takes the
chunked path.

a8w8 (per-token int8 activations x per-channel int8 weights) runs fbgemm's dynamic int8 GEMM
exactly: fbgemm quantizes its input per tensor (uint8, 0..127 with reduce_range), so it is fed
the reference's own activation codes split into positive and negative parts, rows
[max(c, 0); max(-c, 0)] (2T, K), each in 0..127 with a 127 present (every token's largest
|code| is 127). fbgemm then picks scale 1 and zero point 0, quantizes losslessly, accumulates
in int32 (no vpmaddubsw saturation: 2 * 127 * 127 < 2**15) and returns acc * s_w; the two
halves subtract to the exact integer product. Only the fp32 epilogue order differs from the
reference (about 1 ulp). Past A8W8_FBGEMM_MAX_TOKENS an fp32 GEMM over the integer codes takes
over (exact while |partial sums| < 2**24, always for K <= 1040; relative 2**-24 otherwise).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.backends.cpu import native, parallel
from flashllm.ops.quant_matmul import (
    AFFINE_CAPABILITY,
    INT4_SYMMETRIC_ZERO,
    INT8_MAX,
    QuantizedWeight,
    integer_codes,
    quantize_activation_int8,
)
from flashllm.ops.quant_matmul import quant_matmul as reference
from flashllm.quant.gguf_activations import round_activations
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# no fp8: see backends/cpu/__init__.py; AFFINE_CAPABILITY: GGUF layouts (offsets, groups of 16)
QUANT = frozenset({"none", "w8a16", "w4a16", "a8w8", AFFINE_CAPABILITY})

# fbgemm's packed int8 GEMM (the "x86" engine uses it too); qnnpack/onednn quantize differently
FBGEMM_ENGINES = ("x86", "fbgemm")
FBGEMM_READY = ("fbgemm" in torch.backends.quantized.supported_engines
                and torch.backends.quantized.engine in FBGEMM_ENGINES)
A8W8_FBGEMM_MAX_TOKENS = 64

PACKED_CAPABILITIES = frozenset({"AVX512"})
PACKED_FAST = torch.backends.cpu.get_cpu_capability() in PACKED_CAPABILITIES
# torch's packed kernels are GEMV-like tiny GEMMs (4-row blocks); past a decode batch a BLAS
# GEMM over dequantized rows wins
PACKED_MAX_TOKENS = 4
INT4PACK_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
INT4PACK_N_MULTIPLE = 16                   # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0
# a dequantized chunk of about this size stays in the L2/L3 cache between its writes and the GEMM
CHUNK_BYTES = 4 << 20
MIN_CHUNK_ROWS = 64


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W.T + bias for x (T, K) float and any weight scheme; (T, N) in x.dtype.

    "none" is the reference body; quantized weights run the path `choose_path` picks.
    """
    return run_path(choose_path(weight, x.shape[0], PACKED_FAST), x, weight, bias)


def rounded_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs on which quant_matmul computes the reference's product (the conformance suite
    reads this off the kernel): a w4a16 (or, opted in, w8a16) decode batch that the native kernel
    runs against int8 activations sees x rounded per block (native.int8_rounded, after any act-order permutation),
    in fp32; every other call sees its inputs as given."""
    x, weight = inputs["x"], inputs["weight"]
    path = choose_path(weight, x.shape[0], PACKED_FAST)
    if path == "native_prompt":
        terms = native.prompt_terms(weight)
    elif path == "native" and native.int8_activations(weight):
        terms = 1
    elif path == "dequant" and native.llama_format(weight):
        terms = 1
    else:
        return inputs
    rounded = {key: v.float() if key in ("x", "bias") and isinstance(v, Tensor) else v for key, v in inputs.items()}
    x = rounded["x"]
    fmt = native.llama_format(weight) if terms == 1 else None
    if fmt is not None:  # llama.cpp's blocks (q8_1's fp16 sums are a second term the inputs cannot carry)
        rounded["x"] = round_activations(x.reshape(-1, x.shape[-1]), fmt)[0].reshape(x.shape).to(x.dtype)
        return rounded
    if weight.input_perm is None:
        rounded["x"] = native.int8_rounded(x, terms)
    else:
        rounded["x"] = torch.empty_like(x).index_copy_(-1, weight.input_perm,
                                                       native.int8_rounded(x.index_select(-1, weight.input_perm), terms))
    return rounded


quant_matmul.rounded_inputs = rounded_inputs  # type: ignore[attr-defined]


def run_path(path: str, x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """quant_matmul through one named body (see choose_path); tests force each one here."""
    if path == "dense":
        return dense_matmul(x, weight, bias)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    if weight.input_perm is not None:
        x = x.index_select(-1, weight.input_perm)
    if path == "a8w8_fbgemm":
        return a8w8_fbgemm(x, weight, bias)
    if path == "a8w8_dequant":
        return a8w8_dequant(x, weight, bias)
    if path == "native":
        out = native.int_linear(x, weight)
        return (out if bias is None else out.add_(bias.float())).to(x.dtype)
    if path == "native_prompt":
        out = native.prompt_linear(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.out_features)
        return (out if bias is None else out.add_(bias.float())).to(x.dtype)
    if path == "int8pack":
        out = torch._weight_int8pack_mm(x.contiguous(), weight.data, weight.scales.view(-1).to(x.dtype))
    elif path == "int4pack":
        packed, scales_and_zeros = int4pack_layout(weight, x.dtype)
        out = torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, _int4pack_group(weight), scales_and_zeros)
    elif path == "dequant":
        fmt = native.llama_format(weight)
        if fmt is not None:
            return llama_dequant_matmul(x, weight, fmt, bias)
        return dequant_matmul(x, weight, bias)
    else:
        raise ValueError(f"unknown cpu quant_matmul path {path!r}; expected dense, native, native_prompt, int8pack, "
                         "int4pack, dequant, a8w8_fbgemm or a8w8_dequant")
    return out if bias is None else out.add_(bias.to(out.dtype))


def choose_path(
    weight: QuantizedWeight, num_tokens: int, packed_fast: bool, fbgemm: bool = FBGEMM_READY,
    native_ready: bool | None = None,
) -> str:
    """Which body runs: "dense", "native" (csrc/decode_kernels.c), "native_prompt" (a prompt on
    csrc/int4_int8_kernels.c, native.prompt_linear), "int8pack", "int4pack", "dequant"
    (chunked dequantize + GEMM), "a8w8_fbgemm" or "a8w8_dequant". native_ready None = whether the
    native library loads here."""
    if weight.scheme in ("none", "fp8"):  # fp8 is not claimed here; the reference body is the answer
        return "dense"
    if weight.scheme == "a8w8":
        return "a8w8_fbgemm" if fbgemm and num_tokens <= A8W8_FBGEMM_MAX_TOKENS else "a8w8_dequant"
    if native_ready is None:
        native_ready = native.library() is not None
    if native_ready and native.supports_quantized(weight, num_tokens):
        return "native"
    if native_ready and native.supports_prompt(weight, num_tokens):
        return "native_prompt"
    if not packed_fast or num_tokens > PACKED_MAX_TOKENS or weight.offsets is not None:
        return "dequant"
    if weight.scheme == "w8a16" and weight.num_groups == 1:
        return "int8pack"
    if weight.scheme == "w4a16" and int4pack_supported(weight):
        return "int4pack"
    return "dequant"


def int4pack_supported(weight: QuantizedWeight) -> bool:
    """Whether torch's CPU int4 kernel can hold this weight (N % 16, a group size it takes)."""
    return weight.out_features % INT4PACK_N_MULTIPLE == 0 and _int4pack_group(weight) > 0


def _int4pack_group(weight: QuantizedWeight) -> int:
    """The group size handed to torch (0 if none fits); per-channel scales repeat over 256-wide groups."""
    if weight.group_size != -1:
        return weight.group_size if weight.group_size in INT4PACK_GROUP_SIZES else 0
    return next((g for g in INT4PACK_GROUP_SIZES if weight.in_features % g == 0), 0)


def int4pack_layout(weight: QuantizedWeight, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """torch's CPU int4 tile layout of a w4a16 weight, built once per dtype into weight.kernel_cache.

    Returns (packed uint8 (N, K/2) in torch's tile order, scales_and_zeros (K/g, N, 2) in dtype).
    torch dequantizes (code - 8) * scale + zero, so our (code - zp) * scale has zero = (8 - zp) * scale.
    """
    cache, key = weight.kernel_cache, "cpu_int4pack"
    if key not in cache:
        codes, zp = integer_codes(weight)
        cache[key] = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # inner k tiles: unused on CPU
        cache[key + ":zp"] = zp
    if f"{key}:{dtype}" not in cache:
        repeat = weight.in_features // _int4pack_group(weight) // weight.num_groups  # > 1 only per channel
        scales = weight.scales.float().repeat_interleave(repeat, dim=1)
        zero = (INT4_SYMMETRIC_ZERO - cache[key + ":zp"]).float().repeat_interleave(repeat, dim=1) * scales
        cache[f"{key}:{dtype}"] = torch.stack((scales, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
    return cache[key], cache[f"{key}:{dtype}"]


def dense_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """The reference body, with a decode-sized float product on the native fp32 kernel where it
    loads, else split by rows across the cores through torch."""
    w = weight.data
    fmt = native.llama_format(weight) if weight.scheme == "none" else None
    if fmt is not None:  # a GGUF head kept as float: its input as llama.cpp's integer product sees it
        x = native.round_activations(x.reshape(-1, x.shape[-1]), fmt).reshape(x.shape).to(x.dtype)
    if weight.scheme != "none" or weight.input_perm is not None or x.dim() != 2:
        return reference(x, weight, bias)
    use_native = native.supports_dense(x, w)
    if not use_native and not parallel.should_split(x.shape[0], *w.shape):
        return reference(x, weight, bias)
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    out = native.f32_linear(x, w) if use_native else parallel.split_linear(x, w.to(x.dtype))
    return out if bias is None else out.add_(bias.to(x.dtype))


def dequant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """x (T, K) @ dequantized W.T + bias in fp32, a chunk of output rows at a time; (T, N) in x.dtype.

    fp32 like the reference: half weights would round every element, and CPUs without native
    half arithmetic run fp32 GEMMs faster anyway. Per-channel scales multiply the (T, N) output
    instead of the (N, K) weight.
    """
    n, k = weight.out_features, weight.in_features
    rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (k * 4))
    x32 = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    per_channel = weight.num_groups == 1 and weight.offsets is None
    scales = weight.scales.float()
    zeros = None if weight.zeros is None else weight.zeros.float()

    def body(first: int, last: int) -> None:  # rows first:last, a chunk at a time through one buffer
        buffer = torch.empty(min(rows, last - first), k, dtype=torch.float32, device=x.device)
        for start in range(first, last, rows):
            end = min(start + rows, last)
            chunk = buffer[: end - start]
            _dequant_rows(weight, start, end, chunk, None if per_channel else scales, zeros)
            out[:, start:end] = F.linear(x32, chunk)

    if parallel.should_split(x.shape[0], n, k):
        parallel.run_shares(n, body)  # each core dequantizes and multiplies its own rows
    else:
        body(0, n)
    if per_channel:
        out.mul_(scales.view(1, n))
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype)


def llama_dequant_matmul(x: Tensor, weight: QuantizedWeight, fmt: str, bias: Tensor | None = None) -> Tensor:
    """A GGUF weight's product as llama.cpp's CPU backend computes it, for prompts: x (..., K) rounded to
    its `fmt` blocks (flashllm/quant/gguf_activations.py), then the fp32 GEMM of dequant_matmul; q8_1's
    fp16 block sums meet the weight's minimums in a (T, K / 32) x (K / 32, N) product. The same
    values as llama.cpp's integer dot products up to the fp32 order of the sums; (..., N) in x.dtype."""
    flat = x.reshape(-1, x.shape[-1])
    rounded, correction = round_activations(flat, fmt)
    out = dequant_matmul(rounded.float(), weight, bias)
    if correction is not None and weight.offsets is not None and weight.num_groups == correction.shape[-1]:
        out.add_((correction @ weight.offsets.double().T).float())
    return out.reshape(*x.shape[:-1], weight.out_features).to(x.dtype)


def _dequant_rows(
    weight: QuantizedWeight, start: int, end: int, chunk: Tensor, scales: Tensor | None, zeros: Tensor | None
) -> None:
    """Write rows start:end of (code - zero) [* scale] into chunk (rows, K); scales None = leave unscaled."""
    rows, k = chunk.shape
    data = weight.data[start:end]
    if weight.scheme in ("w8a16", "a8w8"):
        chunk.copy_(data)
    else:
        pairs = chunk.view(rows, k // 2, 2)
        pairs[..., 0].copy_(data & 0xF)
        pairs[..., 1].copy_(data >> 4)
        grouped = chunk.view(rows, weight.num_groups, k // weight.num_groups)
        if zeros is not None:
            grouped.sub_(zeros[start:end, :, None])
        elif weight.offsets is None:  # symmetric; an affine weight (offsets) has zero point 0
            chunk.sub_(INT4_SYMMETRIC_ZERO)
    if scales is not None:
        chunk.view(rows, weight.num_groups, k // weight.num_groups).mul_(scales[start:end, :, None])
    if weight.offsets is not None:  # a separate add, as the reference's dequantize
        chunk.view(rows, weight.num_groups, k // weight.num_groups).add_(weight.offsets[start:end, :, None].float())


def fbgemm_packed(weight: QuantizedWeight) -> torch.ScriptObject:
    """fbgemm's packed per-channel int8 layout of an a8w8 weight, built once into weight.kernel_cache."""
    cache, key = weight.kernel_cache, "cpu_fbgemm_a8w8"
    if key not in cache:
        zero_points = torch.zeros(weight.out_features, dtype=torch.int64)
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm takes nothing else
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                weight.data, weight.scales.view(-1).to(torch.float64), zero_points, 0
            )
            cache[key] = torch.ops.quantized.linear_prepack(qweight, None)
    return cache[key]


def a8w8_fbgemm(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """a8w8 through fbgemm's int8 GEMM, exact in the integer product (see the module docstring)."""
    codes, x_scales = quantize_activation_int8(x, weight.smooth)  # (T, K) integers, (T, 1)
    tokens = codes.shape[0]
    split = torch.cat((codes.clamp(min=0), codes.neg().clamp_(min=0)))  # (2T, K) in 0..127
    if tokens == 0 or float(split.amax()) != INT8_MAX:
        # every token is (sub)normal-tiny or zero: fbgemm would pick another scale; stay exact
        return a8w8_dequant(x, weight, bias, (codes, x_scales))
    halves = torch.ops.quantized.linear_dynamic(split, fbgemm_packed(weight), True)  # (2T, N) = acc+- * s_w
    out = (halves[:tokens] - halves[tokens:]).mul_(x_scales)
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype)


def a8w8_dequant(
    x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None, quantized: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """a8w8 as an fp32 GEMM of the activation codes with the weight codes, chunked; then * s_w * s_x."""
    codes, x_scales = quantized or quantize_activation_int8(x, weight.smooth)
    out = dequant_matmul(codes, weight).mul_(x_scales)  # codes are fp32: dequant_matmul stays in fp32
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype)


def register(backend: Backend) -> None:
    """Register the cpu quant_matmul kernel on `backend` for every float dtype, weight-only schemes and a8w8."""
    backend.kernel("quant_matmul", Caps(dtypes=FLOATS, kv_dtypes=FLOATS, quant=QUANT))(quant_matmul)
