"""CPU fused_moe: the tokens routed to each chosen expert go through it together; unchosen experts are never read.

A decode step routes a few tokens to a few of E experts, so what it costs is reading the chosen
experts' weights once. The (token, expert) pairs are sorted by expert with one host sync (the
reference syncs once per expert of the layer, chosen or not), and each chosen expert's two products
run on the native fp32 kernel for decode-sized batches (native.f32_linear, split across cores), else
through torch. fp16 / bf16 experts are widened to fp32 one chosen expert at a time, so the numerics
are the reference's.

    python -m flashllm.backends.cpu.moe   # this kernel against the reference on a decode step
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flashllm.backends.cpu import native
from flashllm.ops.fused_moe import (
    EXPERT_SCHEMES,
    MOE_ACTIVATIONS,
    check_expert_biases,
    check_expert_scales,
    expert_activation,
    expert_batches,
    expert_int4,
)
from flashllm.ops.quant_matmul import QuantizedWeight, dequantize
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_scale: Tensor | None = None, w2_scale: Tensor | None = None, w13_bias: Tensor | None = None,
              w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    """The fused_moe op (flashllm.ops.fused_moe): x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_weights /
    topk_ids (T, k) -> (T, H) in x.dtype; products, activation and the weighted sum in fp32. Float
    experts, w8a16 int8 codes with w13_scale (E, 2I) / w2_scale (E, H), or w4a16 packed int4 codes with
    grouped scales (E, N, G); int4 experts run native only with FLASHLLM_CPU_INT4_ACTIVATIONS=fp32 (the
    default int8 activations are not this op's numerics), else each chosen one is dequantized. Biases
    (E, 2I) / (E, H) and the "swigluoai" activation (gpt-oss) as the op defines them."""
    check_expert_scales(w13, w2, w13_scale, w2_scale)
    check_expert_biases(w13, w2, w13_bias, w2_bias, activation)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    experts = _Experts(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, activation)
    for expert, rows, weights in expert_batches(topk_ids, topk_weights, w13.shape[0]):
        if rows is None:  # the one decode token
            out += experts.run(xf, expert) * weights
        else:
            out.index_add_(0, rows, experts.run(xf[rows], expert) * weights)
    return out.to(x.dtype)


class _Experts(NamedTuple):
    """One fused_moe call's expert tensors, as the op takes them."""

    w13: Tensor
    w2: Tensor
    w13_scale: Tensor | None
    w2_scale: Tensor | None
    w13_bias: Tensor | None
    w2_bias: Tensor | None
    activation: str

    def run(self, x: Tensor, expert: int) -> Tensor:
        """Expert `expert`'s gated MLP on fp32 rows x (n, H) -> (n, H) fp32."""
        gate_up = _linear(x, self.w13, self.w13_scale, expert)
        if self.w13_bias is not None:
            gate_up = gate_up + self.w13_bias[expert].float()
        out = _linear(expert_activation(gate_up, self.activation), self.w2, self.w2_scale, expert)
        return out if self.w2_bias is None else out + self.w2_bias[expert].float()


def _linear(x: Tensor, weights: Tensor, scales: Tensor | None, expert: int) -> Tensor:
    """fp32 x (n, K) @ expert `expert`'s (N, K) weight .T -> (n, N) fp32, in any of the op's formats.

    Decode-sized products run native where that is exact: fp32 weights on f32_linear, int8 and int4
    ones (groups of a multiple of 32 features, fp32 activations) on int_linear, reading one byte or
    half a byte a weight; else the expert's weight is widened to fp32 for torch.
    """
    if scales is None:
        weight = weights[expert].float()  # a no-op for fp32; one expert's rows widened for fp16 / bf16
        if native.supports_dense(x, weight):
            return native.f32_linear(x, weight)
        return F.linear(x, weight)
    if weights.dtype == torch.uint8:
        qweight = expert_int4(weights, scales, expert)
    else:
        qweight = QuantizedWeight("w8a16", weights[expert], scales[expert].float()[:, None])
    # the native int4 products quantize activations to int8 unless told not to: not this op's numerics
    if native.supports_quantized(qweight, x.shape[0]) and not native.int8_activations(qweight):
        return native.int_linear(x, qweight, exact=True)  # fp32 activations: not bf16-rounded ones either
    return F.linear(x, dequantize(qweight))


def register(backend: Backend) -> None:
    """Register the cpu fused_moe kernel on `backend` (it reads expert ids on the host: not graph safe)."""
    backend.kernel("fused_moe", Caps(dtypes=FLOATS, quant=EXPERT_SCHEMES, graph_safe=False,
                                              moe_activations=MOE_ACTIVATIONS))(fused_moe)


def _bench(argv: list[str] | None = None) -> None:
    """Time this kernel and the reference on one decode-sized call (a Qwen1.5-MoE-like layer by default)."""
    from flashllm.ops.fused_moe import fused_moe as reference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--experts", type=int, default=60)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--w8a16", action="store_true", help="int8 experts with per-channel scales")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    h, i, e = args.hidden, args.intermediate, args.experts
    x = torch.randn(args.tokens, h, generator=gen)
    weights: tuple[Tensor, ...] = (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5,
                                   torch.randn(e, h, i, generator=gen) * i**-0.5)
    if args.w8a16:  # codes and scales as a MoE layer stores them
        scales = [w.abs().amax(dim=-1) / 127 for w in weights]
        codes = [torch.round(w / s[..., None]).to(torch.int8) for w, s in zip(weights, scales, strict=True)]
        weights = (codes[0], codes[1])
    probs = torch.softmax(torch.randn(args.tokens, e, generator=gen), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, args.top_k, dim=-1)
    call = (x, *weights, topk_weights, topk_ids, *(scales if args.w8a16 else ()))
    bytes_per_weight = 1 if args.w8a16 else 4
    results = {}
    for name, fn in (("reference", reference), ("cpu", fused_moe)):
        fn(*call)  # warm up
        start = time.perf_counter()
        for _ in range(args.iters):
            results[name] = fn(*call)
        seconds = (time.perf_counter() - start) / args.iters
        active = 3 * h * i * bytes_per_weight * len(topk_ids.unique())
        print(f"{name:9s} {seconds * 1e3:8.3f} ms  {active / seconds / 1e9:6.2f} GB/s of chosen experts")
    print(f"max |cpu - reference| = {float((results['cpu'] - results['reference']).abs().max()):.3g}")


if __name__ == "__main__":
    _bench()
