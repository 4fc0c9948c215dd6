"""ipex quant_matmul: IPEX's weight-only-quant linear for w8a16 / w4a16 where it is fast, the cpu kernel elsewhere.

The IPEX body packs each weight once (`torch.ops.ipex_prepack.weight_only_qlinear_prepack`,
kept in weight.kernel_cache) and multiplies with `torch.ops.torch_ipex.ipex_woq_linear` in
lowp_mode NONE on fp32 activations: the weight is dequantized to fp32 and the product is
accumulated in fp32, as the reference does (half activations are widened first and the result
rounded once). IPEX's int4 layout is flashllm's (low nibble = even column, codes 0..15, zero
point 8 when symmetric), so codes pass through unchanged.

Measured with IPEX 2.8 on an AVX2 EPYC (2 threads, batch 1, N=4864 K=896): fp32 GEMV ~4 ms,
ipex int8 WOQ ~25 ms, ipex int4 (group 128) ~95 ms, in every lowp_mode: IPEX's fast WOQ
kernels are AVX-512 code and AVX2 gets a slow generic body. So "auto" runs IPEX's body only
where torch reports AVX512 (IPEX's documented target; not yet timed here) and the cpu kernel
otherwise. FLASHLLM_IPEX_WOQ=1 forces IPEX's body, =0 forbids it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from flashllm.backends.cpu import quant as cpu_quant
from flashllm.backends.ipex.kernels import FLOATS, _ipex
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.registry.backend import Backend, Caps

WOQ_SCHEMES = frozenset({"w8a16", "w4a16"})
WOQ_ENV = "FLASHLLM_IPEX_WOQ"
WOQ_MODES = ("auto", "1", "0")
# torch.backends.cpu.get_cpu_capability() values where IPEX's WOQ kernels are vectorized
WOQ_FAST_CAPABILITIES = frozenset({"AVX512"})
CACHE_KEY = "ipex_woq"
# IPEX's WoqWeightDtype values (INT8 = 1, INT4 = 2) and lowp_mode NONE: compute in x's dtype
_WOQ_DTYPE = {"w8a16": 1, "w4a16": 2}
_LOWP_NONE = 0
_NO_ACT_QUANT = -1


def woq_mode() -> str:
    """FLASHLLM_IPEX_WOQ: "auto" (default; IPEX's body where torch reports AVX512), "1" always, "0" never."""
    mode = os.environ.get(WOQ_ENV, "auto").strip().lower() or "auto"
    if mode not in WOQ_MODES:
        raise ValueError(f"{WOQ_ENV}={mode!r} is not understood; expected one of {WOQ_MODES} "
                         "(auto: IPEX's WOQ linear only on AVX-512 CPUs)")
    return mode


def woq_enabled(capability: str | None = None) -> bool:
    """Whether w8a16 / w4a16 run IPEX's WOQ linear here (see woq_mode); capability defaults to torch's."""
    mode = woq_mode()
    if mode != "auto":
        return mode == "1"
    return (capability or torch.backends.cpu.get_cpu_capability()) in WOQ_FAST_CAPABILITIES


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W.T + bias for x (T, K) float; (T, N) in x.dtype.

    w8a16 / w4a16 run woq_linear where woq_enabled() says so; every other call (scheme "none",
    e.g. lm_head in a quantized model, or a CPU without AVX-512) runs the cpu backend's kernel.
    """
    if weight.scheme in WOQ_SCHEMES and woq_enabled():
        return woq_linear(x, weight, bias)
    return cpu_quant.quant_matmul(x, weight, bias)


def woq_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """IPEX's WOQ linear for a w8a16 / w4a16 weight: x (T, K) float, bias (N,) or None -> (T, N) in x.dtype.

    fp32 throughout (x widened, fp32 bias added), rounded once to x.dtype; input_perm permutes
    x's columns first, as in the reference.
    """
    if weight.scheme not in WOQ_SCHEMES:
        raise ValueError(f"ipex woq_linear takes schemes {sorted(WOQ_SCHEMES)}, got {weight.scheme!r}; "
                         "use quant_matmul, which routes other schemes to the cpu kernel")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects {weight.in_features}")
    if weight.input_perm is not None:
        x = x.index_select(-1, weight.input_perm)
    x32 = x.to(torch.float32).contiguous()
    if x32.shape[0] == 0:
        out = x32.new_empty(0, weight.out_features)
    else:
        out = torch.ops.torch_ipex.ipex_woq_linear(x32, woq_packed(weight))
    if bias is not None:
        out = out.add_(bias.to(torch.float32))
    return out.to(x.dtype)


def woq_packed(weight: QuantizedWeight) -> Tensor:
    """The handle of IPEX's packed copy of `weight`, built on the first call into weight.kernel_cache.

    scales (and int4 zero points, as float codes 0..15) go as (N,) per channel, (N, K/g) grouped;
    symmetric int4 passes no zero points, which IPEX reads as 8 like flashllm.
    """
    cache = weight.kernel_cache
    if CACHE_KEY not in cache:
        _ipex()  # registers torch.ops.ipex_prepack / torch_ipex
        per_channel = weight.group_size == -1
        scales = weight.scales.to(torch.float32)
        zeros = None if weight.zeros is None else weight.zeros.to(torch.float32)
        if per_channel:
            scales = scales.view(-1)
            zeros = None if zeros is None else zeros.view(-1)
        context = torch.ops.ipex_prepack.weight_only_qlinear_prepack(
            weight.data.contiguous(), _WOQ_DTYPE[weight.scheme], [weight.out_features, weight.in_features],
            scales.contiguous(), None if zeros is None else zeros.contiguous(), None, None, None,
            weight.group_size, _LOWP_NONE, _NO_ACT_QUANT, False,
        )
        # the context owns the packed weight the handle points into: keep both alive together
        cache[CACHE_KEY] = (context, context.get_data_handle())
    return cache[CACHE_KEY][1]


def register(backend: Backend) -> None:
    """Register the ipex quant_matmul for weight-only schemes (fp32 models keep the cpu kernel)."""
    backend.kernel("quant_matmul", Caps(dtypes=FLOATS, kv_dtypes=FLOATS, quant=WOQ_SCHEMES))(quant_matmul)
