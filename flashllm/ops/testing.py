"""Random valid inputs for every op, shaped to stress kernels: odd lengths, block edges, GQA."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flashllm.ops._kv_checks import KV_QMAX
from flashllm.ops.alibi_slopes import alibi_slopes
from flashllm.ops.lora_testing import LORA_CASES, expand_inputs, shrink_inputs
from flashllm.ops.quant_matmul import AFFINE_CAPABILITY, QuantizedWeight, pack_int4
from flashllm.ops.rope_cache import build_cos_sin_cache
from flashllm.ops.testing_blocks import random_block_tables  # noqa: F401 (re-exported)
from flashllm.ops.testing_blocks import seeded_randn as _randn
from flashllm.ops.testing_experts import MOE_CASES, fused_moe_inputs
from flashllm.ops.testing_latent import LATENT_CASES, latent_attention_inputs

Inputs = dict[str, Any]


def _rms_norm(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    tokens, hidden = {"plain": (7, 256), "residual": (33, 128), "one_token": (1, 96)}[case]
    inputs = {
        "x": _randn(gen, tokens, hidden, dtype=dtype, device=device),
        "weight": _randn(gen, hidden, dtype=dtype, device=device, std=0.5) + 1,
        "eps": 1e-6,
    }
    if case == "residual":
        inputs["residual"] = _randn(gen, tokens, hidden, dtype=dtype, device=device)
    return inputs


def _layer_norm(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    tokens, hidden = {"plain": (7, 256), "residual": (33, 128), "no_bias": (5, 160), "one_token": (1, 96),
                      "small_variance": (4, 64)}[case]
    # rows off zero mean and unit spread, so a kernel that skips the centering or the variance is caught; rows whose
    # variance (~1e-4) is near eps, so one that drops or misplaces eps is
    std, shift = (1e-2, 2e-2) if case == "small_variance" else (3.0, 1.5)  # fp32 keeps (x - mean) exact enough
    x = _randn(gen, tokens, hidden, dtype=torch.float32, device=device, std=std) + shift
    inputs: Inputs = {
        "x": x.to(dtype),
        "weight": _randn(gen, hidden, dtype=dtype, device=device, std=0.5) + 1,
        "bias": None if case == "no_bias" else _randn(gen, hidden, dtype=dtype, device=device, std=0.5),
        "eps": 1e-5,
    }
    if case == "residual":
        inputs["residual"] = _randn(gen, tokens, hidden, dtype=dtype, device=device)
    return inputs


def _rotary_embedding(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    is_neox, rot_dim, tokens, heads, kv_heads = {
        "neox": (True, head_size, 13, 8, 2),
        "neox_partial": (True, head_size // 2, 5, 4, 4),
        "interleaved": (False, head_size, 1, 7, 1),
        "interleaved_partial": (False, head_size // 2, 2 * block_size + 1, 4, 2),
    }[case]
    max_position = 4 * block_size + 7
    return {
        "positions": torch.randint(0, max_position, (tokens,), generator=gen).to(device),
        "q": _randn(gen, tokens, heads, head_size, dtype=dtype, device=device),
        "k": _randn(gen, tokens, kv_heads, head_size, dtype=dtype, device=device),
        "cos_sin_cache": build_cos_sin_cache(rot_dim, max_position, 10000.0).to(device),
        "is_neox": is_neox,
    }


def _gated(gen: torch.Generator, dtype: torch.dtype, device: str, case: str, with_approximate: bool) -> Inputs:
    tokens, inter = {"odd": (7, 96), "one_token": (1, 64), "tanh": (5, 80)}[case]
    inputs: Inputs = {"x": _randn(gen, tokens, 2 * inter, dtype=dtype, device=device, std=2.0)}
    if with_approximate:
        inputs["approximate"] = "tanh" if case == "tanh" else "none"
    return inputs


# op -> quantized-KV case -> (float case whose layout it reuses, kv dtype, scales). Scales are
# "dynamic" scale caches (num_blocks, block_size, Hk), "heads" static (Hk,) or "scalar" static ().
_KV_QUANT_CASES: dict[str, dict[str, tuple[str, torch.dtype, str]]] = {
    "write_kv_cache": {
        "int8_dynamic": ("mixed_with_padding", torch.int8, "dynamic"),
        "fp8_dynamic": ("prefill", torch.float8_e4m3fn, "dynamic"),
        "int8_static_saturating": ("decode", torch.int8, "heads"),
        "fp8_static_saturating": ("mixed_with_padding", torch.float8_e4m3fn, "scalar"),
    },
    "paged_attention": {
        "int8_dynamic": ("mixed", torch.int8, "dynamic"),
        "fp8_dynamic": ("decode", torch.float8_e4m3fn, "dynamic"),
        "int8_static": ("cached_prefix", torch.int8, "heads"),
        "fp8_static": ("prefill_block_edges", torch.float8_e4m3fn, "scalar"),
    },
}


def _kv_caches(
    gen: torch.Generator,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str,
    kv_dtype: torch.dtype | None = None,
    scales: str = "dynamic",
) -> Inputs:
    """k_cache, v_cache (num_blocks, block_size, kv_heads, head_size) of random content.

    kv_dtype int8 / float8_e4m3fn: random codes over the whole code range plus float32 k_scale,
    v_scale of the `scales` kind, sized so dequantized values are of order 1 (as keys are).
    Static scales put +-qmax * scale at 1 to 3, so writing N(0, 1) keys saturates some codes.
    """
    shape = (num_blocks, block_size, kv_heads, head_size)
    if kv_dtype is None:
        return {"k_cache": _randn(gen, *shape, dtype=dtype, device=device),
                "v_cache": _randn(gen, *shape, dtype=dtype, device=device)}
    qmax = KV_QMAX[kv_dtype]
    scale_shape = {"dynamic": shape[:3], "heads": (kv_heads,), "scalar": ()}[scales]
    inputs: Inputs = {}
    for name in ("k", "v"):
        if kv_dtype == torch.int8:
            codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        else:
            codes = (torch.randn(shape, generator=gen) * qmax / 3).clamp(-qmax, qmax).to(kv_dtype)
        inputs[f"{name}_cache"] = codes.to(device)
        inputs[f"{name}_scale"] = ((torch.rand(scale_shape, generator=gen) + 0.5) * (2.0 / qmax)).to(device)
    return inputs


def case_kv_dtype(op_name: str, case: str) -> torch.dtype | None:
    """The quantized KV cache dtype an input case needs (int8 / float8_e4m3fn), None for a float cache.

    A kernel whose caps.kv_dtypes lack it is not expected to run the case.
    """
    return _KV_QUANT_CASES.get(op_name, {}).get(case, (case, None, ""))[1]


def _write_kv_cache(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    case, kv_dtype, scales = _KV_QUANT_CASES["write_kv_cache"].get(case, (case, None, ""))
    seq_lens, kv_heads = {
        "prefill": ([block_size + 3], 2),
        "mixed_with_padding": ([block_size, 5, 2 * block_size - 1], 1),
        "decode": ([1, 1, 1], 4),
    }[case]
    tables, num_blocks = random_block_tables(gen, seq_lens, block_size)
    slots = []
    for b, n in enumerate(seq_lens):
        slots += [int(tables[b, i // block_size]) * block_size + i % block_size for i in range(n)]
    if case == "mixed_with_padding":
        slots[2], slots[-1] = -1, -1
    tokens = len(slots)
    caches = _kv_caches(gen, num_blocks, block_size, kv_heads, head_size, dtype, device, kv_dtype, scales)
    return {
        "k": _randn(gen, tokens, kv_heads, head_size, dtype=dtype, device=device),
        "v": _randn(gen, tokens, kv_heads, head_size, dtype=dtype, device=device),
        **caches,
        "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=device),
    }


def _attention_layout(case: str, bs: int) -> tuple[list[int], list[int], int, int]:
    """(q_lens, seq_lens, num_heads, num_kv_heads) of each paged_attention case."""
    return {
        "prefill": ([bs + 3], [bs + 3], 4, 4),
        "prefill_block_edges": ([bs, 2 * bs], [bs, 2 * bs], 8, 4),
        "cached_prefix": ([7, bs + 1], [2 * bs + 5, 3 * bs + 1], 8, 2),
        "decode": ([1, 1, 1, 1], [1, bs, bs + 1, 3 * bs - 1], 7, 1),
        "mixed": ([bs - 1, 1, 5, bs + 2], [bs - 1, 2 * bs + 1, 5, 3 * bs], 8, 2),
        "sliding_window": ([bs - 1, 1, 5, bs + 2], [bs - 1, 2 * bs + 1, 5, 3 * bs], 4, 1),
        "alibi": ([bs + 1, 1, 3], [bs + 1, bs, 2 * bs + 3], 8, 8),
        # a chunk after a cached prefix, a decode and a prefill over GQA heads, 6 slopes (not a power of two)
        "alibi_gqa": ([7, 1, bs + 1], [2 * bs + 5, 3 * bs - 1, bs + 1], 6, 2),
        # Gemma 2's capped scores, with a sliding window on one of the sequences' layers' worth of queries
        "softcap": ([bs - 1, 1, 5, bs + 2], [bs - 1, 2 * bs + 1, 5, 3 * bs], 8, 2),
        # gpt-oss's sinks over GQA heads: a prefill, a decode and a chunk after a cached prefix
        "sinks": ([bs + 2, 1, 4], [bs + 2, 2 * bs + 1, 3 * bs], 8, 2),
    }[case]


def _paged_attention(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    case, kv_dtype, scales = _KV_QUANT_CASES["paged_attention"].get(case, (case, None, ""))
    q_lens, seq_lens, heads, kv_heads = _attention_layout(case, block_size)
    tables, num_blocks = random_block_tables(gen, seq_lens, block_size)
    caches = _kv_caches(gen, num_blocks, block_size, kv_heads, head_size, dtype, device, kv_dtype, scales)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    inputs: Inputs = {
        "q": _randn(gen, sum(q_lens), heads, head_size, dtype=dtype, device=device),
        **caches,
        "block_tables": tables.to(device),
        "cu_seqlens_q": cu_seqlens_q.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": head_size**-0.5,
    }
    if case == "sliding_window":
        inputs["sliding_window"] = block_size // 2 + 3
    if case == "alibi":
        # the geometric slopes ALiBi models use for 8 heads: 2^-1 .. 2^-8
        inputs["alibi_slopes"] = torch.tensor([2.0 ** -(h + 1) for h in range(heads)], device=device)
    if case == "alibi_gqa":
        inputs["alibi_slopes"] = alibi_slopes(heads).to(device)
    if case == "softcap":  # scores of unit-variance q, k reach past 1.5 * sqrt(d) / sqrt(d): the cap bends them
        inputs["logit_softcap"] = 1.5
    if case == "sinks":  # sink logits around the scores' own size, so each takes a visible share of the softmax
        inputs["sinks"] = (torch.randn(heads, generator=gen) * 2).to(device)
    return inputs


class _QuantCase(NamedTuple):
    """One quant_matmul input case: x (tokens, in_features), a weight (out_features, in_features)."""

    tokens: int
    in_features: int
    out_features: int
    scheme: str
    group_size: int = -1
    asymmetric: bool = False
    bias: bool = False
    smooth: bool = False      # SmoothQuant factors (a8w8 / fp8)
    input_perm: bool = False  # GPTQ act-order column permutation
    gguf: bool = False        # a GGUF layout (flashllm.quant.gguf_blocks): needs the AFFINE_CAPABILITY caps
    offsets: bool = False     # per-group float offsets (Q4_1, Q4_K, Q5_K)


# Quantized cases cover per-channel and grouped scales, int4 with and without zero points, one
# decode token and several, out_features that torch's CPU int4 layout can (N % 16 == 0) and
# cannot hold, and a8w8/fp8 with and without smoothing and act-order permutation (80 tokens
# reach the cpu kernel's large-batch a8w8 body). Weight-only cases carry no input_perm: the
# GPU/NPU weight-only kernels do not take it yet (tests/unit checks the reference and cpu paths).
_QUANT_MATMUL_CASES: dict[str, _QuantCase] = {
    "bias": _QuantCase(7, 96, 80, "none", bias=True),
    "no_bias": _QuantCase(1, 128, 33, "none"),
    "w8a16_per_channel": _QuantCase(1, 96, 80, "w8a16", bias=True),
    "w8a16_group64_tokens": _QuantCase(9, 128, 48, "w8a16", 64),
    "w4a16_group32_sym": _QuantCase(1, 128, 64, "w4a16", 32, bias=True),
    "w4a16_group128_asym": _QuantCase(5, 256, 48, "w4a16", 128, asymmetric=True),
    "w4a16_group64_asym_odd_n": _QuantCase(3, 64, 33, "w4a16", 64, asymmetric=True, bias=True),
    "w4a16_per_channel": _QuantCase(1, 256, 32, "w4a16"),
    "a8w8_decode": _QuantCase(1, 96, 80, "a8w8", bias=True),
    "a8w8_tokens_smooth": _QuantCase(9, 128, 48, "a8w8", smooth=True),
    "a8w8_prefill_smooth_perm": _QuantCase(80, 64, 40, "a8w8", bias=True, smooth=True, input_perm=True),
    "fp8_decode": _QuantCase(1, 96, 33, "fp8", bias=True),
    "fp8_tokens_smooth_perm": _QuantCase(6, 128, 48, "fp8", smooth=True, input_perm=True),
    # GGUF layouts: Q4_1/Q4_K (int4 + offsets), Q5_K (5-bit codes in int8 + offsets), Q6_K (group 16)
    "gguf_w4a16_group32_offsets": _QuantCase(1, 256, 64, "w4a16", 32, bias=True, gguf=True, offsets=True),
    "gguf_w4a16_group32_offsets_tokens": _QuantCase(5, 512, 33, "w4a16", 32, gguf=True, offsets=True),
    "gguf_w8a16_group32_offsets": _QuantCase(2, 256, 48, "w8a16", 32, gguf=True, offsets=True),
    "gguf_w8a16_group16": _QuantCase(1, 256, 40, "w8a16", 16, bias=True, gguf=True),
    "gguf_w8a16_group16_tokens": _QuantCase(3, 512, 64, "w8a16", 16, gguf=True),
}
# e4m3 bit patterns that are NaN (S.1111.111); every other byte is a finite value
_FP8_NAN_BYTES = (0x7F, 0xFF)


def _random_codes(gen: torch.Generator, n: int, k: int, scheme: str) -> tuple[Tensor, float]:
    """(data in the scheme's storage dtype, a scale std that gives outputs of about unit size)."""
    if scheme in ("w8a16", "a8w8"):
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), k**-0.5 / 64
    if scheme == "fp8":
        raw = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        raw[(raw == _FP8_NAN_BYTES[0]) | (raw == _FP8_NAN_BYTES[1])] = 0
        return raw.view(torch.float8_e4m3fn), k**-0.5 / 128
    return pack_int4(torch.randint(0, 16, (n, k), generator=gen)), k**-0.5 / 4


def _random_quantized(gen: torch.Generator, c: _QuantCase, device: str) -> QuantizedWeight:
    """Random codes and scales (not a quantized float matrix), so kernels meet every code value."""
    n, k = c.out_features, c.in_features
    groups = 1 if c.group_size == -1 else k // c.group_size
    data, scale_std = _random_codes(gen, n, k, c.scheme)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * scale_std
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if c.asymmetric else None
    smooth = torch.exp(0.5 * torch.randn(k, generator=gen)) if c.smooth else None
    perm = torch.randperm(k, generator=gen) if c.input_perm else None
    offsets = None
    if c.gguf and c.scheme == "w8a16":  # 5-bit codes 0..31 with offsets (Q5_K), else 6-bit -32..31 (Q6_K)
        data = torch.randint(0, 32, (n, k), generator=gen).sub_(0 if c.offsets else 32).to(torch.int8)
        scales = scales * 4
    if c.offsets:  # about minus half the group's code range, as the K-quants' minimums are
        offsets = -scales * (torch.rand(n, groups, generator=gen) * (8 if c.scheme == "w4a16" else 16))
    return QuantizedWeight(
        c.scheme, data.to(device), scales.to(device), None if zeros is None else zeros.to(device), c.group_size,
        smooth=None if smooth is None else smooth.to(device), input_perm=None if perm is None else perm.to(device),
        offsets=None if offsets is None else offsets.to(device),
    )


def _quant_matmul(
    gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str
) -> Inputs:
    c = _QUANT_MATMUL_CASES[case]
    inputs: Inputs = {"x": _randn(gen, c.tokens, c.in_features, dtype=dtype, device=device)}
    if c.scheme == "none":
        inputs["weight"] = QuantizedWeight.dense(
            _randn(gen, c.out_features, c.in_features, dtype=dtype, device=device, std=c.in_features**-0.5)
        )
    else:
        inputs["weight"] = _random_quantized(gen, c, device)
    if c.bias:
        inputs["bias"] = _randn(gen, c.out_features, dtype=dtype, device=device)
    return inputs


def case_quant(op_name: str, case: str) -> str:
    """The quantization scheme an input case needs ("none" for every op but quant_matmul's quantized cases).

    A kernel whose caps lack the scheme is not expected to run the case.
    """
    if op_name == "quant_matmul":
        c = _QUANT_MATMUL_CASES[case]
        return AFFINE_CAPABILITY if c.gguf else c.scheme
    if op_name == "fused_moe":
        return MOE_CASES[case].scheme
    return "none"


# input cases -> the Caps claim a kernel must make to run them: a bool flag, or an expert activation
_CASE_CAPS = {("paged_attention", "alibi"): "alibi", ("paged_attention", "alibi_gqa"): "alibi",
              ("paged_attention", "softcap"): "softcap", ("paged_attention", "sinks"): "sinks",
              ("fused_moe", "swigluoai_bias"): "swigluoai", ("fused_moe", "swigluoai_bias_one_token"): "swigluoai"}


def case_caps(op_name: str, case: str) -> frozenset[str]:
    """The Caps claims ("alibi", "softcap", "sinks", "swigluoai") an input case needs: a kernel that does not
    make one of them is never bound for such models, so it is not expected to run the case."""
    flag = _CASE_CAPS.get((op_name, case))
    return frozenset({flag} if flag else ())


def claims(caps: Any, flag: str) -> bool:
    """Whether registry Caps make the claim `flag` of case_caps: a bool field, or an expert activation."""
    return flag in caps.moe_activations if flag == "swigluoai" else bool(getattr(caps, flag))


def unclaimed_case(kernel: Any, op_name: str, case: str) -> bool:
    """Whether `kernel` (a registry Kernel) does not claim a Caps flag the case needs (case_caps)."""
    return any(not claims(kernel.caps, flag) for flag in case_caps(op_name, case))


def _silu(gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str) -> Inputs:
    return _gated(gen, dtype, device, case, with_approximate=False)


def _gelu(gen: torch.Generator, dtype: torch.dtype, device: str, head_size: int, block_size: int, case: str) -> Inputs:
    return _gated(gen, dtype, device, case, with_approximate=True)


_BUILDERS: dict[str, tuple[Callable[..., Inputs], tuple[str, ...]]] = {
    "rms_norm": (_rms_norm, ("plain", "residual", "one_token")),
    "layer_norm": (_layer_norm, ("plain", "residual", "no_bias", "one_token", "small_variance")),
    "rotary_embedding": (_rotary_embedding, ("neox", "neox_partial", "interleaved", "interleaved_partial")),
    "silu_and_mul": (_silu, ("odd", "one_token")),
    "gelu_and_mul": (_gelu, ("odd", "one_token", "tanh")),
    "write_kv_cache": (_write_kv_cache, ("prefill", "mixed_with_padding", "decode",
                                         *_KV_QUANT_CASES["write_kv_cache"])),
    "paged_attention": (
        _paged_attention,
        ("mixed", "prefill", "prefill_block_edges", "cached_prefix", "decode", "sliding_window", "alibi", "alibi_gqa",
         "softcap", "sinks", *_KV_QUANT_CASES["paged_attention"]),
    ),
    "quant_matmul": (_quant_matmul, tuple(_QUANT_MATMUL_CASES)),
    "fused_moe": (fused_moe_inputs, tuple(MOE_CASES)),
    "lora_shrink": (shrink_inputs, tuple(LORA_CASES)),
    "lora_expand": (expand_inputs, tuple(LORA_CASES)),
    "latent_attention": (latent_attention_inputs, LATENT_CASES),
}


def cases(op_name: str) -> Iterator[str]:
    """The case names `make_inputs` knows for `op_name`, most representative first."""
    if op_name not in _BUILDERS:
        raise KeyError(f"no input builder for op {op_name!r}; known: {sorted(_BUILDERS)}")
    yield from _BUILDERS[op_name][1]


def make_inputs(
    op_name: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    *,
    head_size: int = 64,
    block_size: int = 16,
    seed: int = 0,
    case: str | None = None,
) -> Inputs:
    """Keyword arguments for one call of `op_name`: random but valid, in `dtype` on `device`.

    `case` picks a shape from `cases(op_name)` (default: the first). head_size applies to
    rotary_embedding, write_kv_cache and paged_attention; block_size to the last two, whose
    lengths are placed at and across block edges. The same seed gives the same values anywhere.
    """
    names = tuple(cases(op_name))
    case = names[0] if case is None else case
    if case not in names:
        raise KeyError(f"op {op_name!r} has no input case {case!r}; known: {names}")
    gen = torch.Generator().manual_seed(seed)
    return _BUILDERS[op_name][0](gen, dtype, str(device), head_size, block_size, case)


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """`value` with fn applied to each tensor of a Tensor, a QuantizedWeight or a dict of them (others as they are)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, QuantizedWeight):  # a new weight: its kernel_cache starts empty
        return QuantizedWeight(
            value.scheme, fn(value.data), _map_tensors(value.scales, fn), _map_tensors(value.zeros, fn),
            value.group_size, smooth=_map_tensors(value.smooth, fn), input_perm=_map_tensors(value.input_perm, fn),
            offsets=_map_tensors(value.offsets, fn),
        )
    if isinstance(value, dict):
        return {name: _map_tensors(item, fn) for name, item in value.items()}
    return value


def clone_inputs(inputs: Inputs) -> Inputs:
    """A deep copy of the tensors in `inputs` (kernels may write in place)."""
    return _map_tensors(inputs, Tensor.clone)


def to_device(value: Any, device: str | torch.device) -> Any:
    """A Tensor, QuantizedWeight or Inputs dict with every tensor moved to `device` (dtypes kept).

    A strided view arrives contiguous, so tests of strided inputs take their views after moving.
    """
    return _map_tensors(value, lambda tensor: tensor.to(device))


def run_case(fn: Callable[..., Any], op_name: str, inputs: Inputs) -> Any:
    """Call fn on a copy of inputs and return what to compare: the result, or the caches it wrote."""
    args = clone_inputs(inputs)
    result = fn(**args)
    if op_name == "latent_attention":  # the latents it wrote count as much as its output
        return result, args["kv_cache"]
    if op_name == "write_kv_cache":
        # a quantized write also fills the dynamic scale caches (static scales must stay as they were)
        return tuple(args[name] for name in ("k_cache", "v_cache", "k_scale", "v_scale") if name in args)
    return result
