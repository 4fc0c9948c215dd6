"""Micro-benchmark of one Triton kernel against its op's PyTorch reference, after a correctness check.

    python -m flashllm.backends.cuda.bench --kernel paged_attention --mode decode --dtype bfloat16
    python -m flashllm.backends.cuda.bench --kernel quant_matmul --scheme w4a16 --tokens 1 --hidden 4096 --out-features 4096
    python -m flashllm.backends.cuda.bench --kernel fused_moe --tokens 16 --experts 8 --top-k 2

Needs an NVIDIA/ROCm GPU: elsewhere it says so and exits 2 (interpreter timings mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from flashllm.backends.cuda import kernels
from flashllm.ops import op_specs
from flashllm.ops.testing import clone_inputs
from flashllm.ops.tolerances import assert_close

Inputs = dict[str, Any]
NO_GPU = 2


def _randn(*shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def _norm_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, h = args.tokens, args.hidden
    inputs = {"x": _randn(t, h, dtype=dtype, device=device), "weight": _randn(h, dtype=dtype, device=device),
              "eps": 1e-6, "residual": _randn(t, h, dtype=dtype, device=device)}
    return inputs, (4 * t * h + h) * dtype.itemsize  # read x, residual, weight; write out, residual


def _gated_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, i = args.tokens, args.intermediate
    return {"x": _randn(t, 2 * i, dtype=dtype, device=device)}, 3 * t * i * dtype.itemsize


def _rotary_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    from flashllm.ops.rope_cache import build_cos_sin_cache

    t, hq, hk, d = args.tokens, args.heads, args.kv_heads, args.head_size
    inputs = {
        "positions": torch.randint(0, 8192, (t,), device=device),
        "q": _randn(t, hq, d, dtype=dtype, device=device),
        "k": _randn(t, hk, d, dtype=dtype, device=device),
        "cos_sin_cache": build_cos_sin_cache(d, 8192, 10000.0).to(device),
        "is_neox": True,
    }
    return inputs, 2 * t * (hq + hk) * d * dtype.itemsize + t * d * 4  # q, k read+write; cache rows


def _paged(dtype: torch.dtype, device: str, seqs: int, context: int, args: argparse.Namespace) -> tuple[Inputs, int]:
    bs, hk, d = args.block_size, args.kv_heads, args.head_size
    per_seq = -(-context // bs)
    tables = torch.randperm(seqs * per_seq, device=device).view(seqs, per_seq).to(torch.int32)
    shape = (seqs * per_seq, bs, hk, d)
    return {"k_cache": _randn(*shape, dtype=dtype, device=device), "v_cache": _randn(*shape, dtype=dtype, device=device),
            "block_tables": tables}, 2 * seqs * context * hk * d * dtype.itemsize


def _write_kv_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, hk, d = args.tokens, args.kv_heads, args.head_size
    cache, _ = _paged(dtype, device, 1, t, args)
    slots = torch.randperm(cache["k_cache"].shape[0] * args.block_size, device=device)[:t]
    inputs = {"k": _randn(t, hk, d, dtype=dtype, device=device), "v": _randn(t, hk, d, dtype=dtype, device=device),
              "k_cache": cache["k_cache"], "v_cache": cache["v_cache"], "slot_mapping": slots}
    return inputs, 4 * t * hk * d * dtype.itemsize + 8 * t


def _attention_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    decode = args.mode == "decode"
    seqs, q_len = (args.seqs, 1) if decode else (max(args.tokens // args.context, 1), args.context)
    inputs, kv_bytes = _paged(dtype, device, seqs, args.context, args)
    inputs.update(
        q=_randn(seqs * q_len, args.heads, args.head_size, dtype=dtype, device=device),
        cu_seqlens_q=torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((seqs,), args.context, dtype=torch.int32, device=device),
        scale=args.head_size**-0.5,
    )
    return inputs, kv_bytes + 2 * seqs * q_len * args.heads * args.head_size * dtype.itemsize


def _quant_matmul_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    from flashllm.ops.quant_matmul import QuantizedWeight
    from flashllm.quant.weight_only import quantize_weight

    m, k, n = args.tokens, args.hidden, args.out_features
    dense = _randn(n, k, dtype=torch.float32, device=device) * k**-0.5
    weight = (QuantizedWeight.dense(dense.to(dtype)) if args.scheme == "none"
              else quantize_weight(dense, args.scheme, args.group_size, symmetric=not args.asymmetric))
    inputs = {"x": _randn(m, k, dtype=dtype, device=device), "weight": weight}
    return inputs, weight.nbytes + (m * k + m * n) * dtype.itemsize


def _fused_moe_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    scores = torch.randn(t, e, device=device)
    topk_weights, topk_ids = torch.softmax(scores, dim=-1).topk(k, dim=-1)
    inputs = {"x": _randn(t, h, dtype=dtype, device=device),
              "w13": _randn(e, 2 * i, h, dtype=dtype, device=device) * h**-0.5,
              "w2": _randn(e, h, i, dtype=dtype, device=device) * i**-0.5,
              "topk_weights": topk_weights / topk_weights.sum(-1, keepdim=True), "topk_ids": topk_ids}
    experts_hit = int(topk_ids.unique().numel())
    return inputs, (experts_hit * 3 * i * h + 2 * t * h) * dtype.itemsize


def _dense_matmul_baseline(inputs: Inputs) -> Callable[[], Any]:
    """torch's own matmul on the weight dequantized once to x.dtype: what the quantized kernel must beat."""
    from flashllm.ops.quant_matmul import dequantize

    x = inputs["x"]
    w = dequantize(inputs["weight"], x.dtype)
    return lambda: torch.nn.functional.linear(x, w)


def _expert_loop_baseline(inputs: Inputs) -> Callable[[], Any]:
    """One torch matmul pair per expert hit, in x.dtype (the reference does the same in fp32)."""
    x, w13, w2, weights, ids = (inputs[name] for name in ("x", "w13", "w2", "topk_weights", "topk_ids"))

    def run() -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            token_idx, slot_idx = (ids == expert).nonzero(as_tuple=True)
            gate, up = (x[token_idx] @ w13[expert].T).chunk(2, dim=-1)
            down = (torch.nn.functional.silu(gate) * up) @ w2[expert].T
            out.index_add_(0, token_idx, down * weights[token_idx, slot_idx, None].to(x.dtype))
        return out

    return run


# op -> (name, builder of a timed callable) compared beside the kernel and the op's reference
BASELINES: dict[str, tuple[str, Callable[[Inputs], Callable[[], Any]]]] = {
    "quant_matmul": ("torch dense matmul", _dense_matmul_baseline),
    "fused_moe": ("torch expert loop", _expert_loop_baseline),
}


BUILDERS: dict[str, Callable[[torch.dtype, str, argparse.Namespace], tuple[Inputs, int]]] = {
    "rms_norm": _norm_inputs,
    "silu_and_mul": _gated_inputs,
    "gelu_and_mul": _gated_inputs,
    "rotary_embedding": _rotary_inputs,
    "write_kv_cache": _write_kv_inputs,
    "paged_attention": _attention_inputs,
    "quant_matmul": _quant_matmul_inputs,
    "fused_moe": _fused_moe_inputs,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashllm.backends.cuda.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", required=True, choices=sorted(kernels.WRAPPERS))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--mode", default="decode", choices=["decode", "prefill"], help="paged_attention batch kind")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens (prefill: total new tokens)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seqs", type=int, default=64, help="decode batch size")
    parser.add_argument("--context", type=int, default=4096, help="keys per sequence")
    parser.add_argument("--out-features", type=int, default=4096, help="quant_matmul N (K is --hidden)")
    parser.add_argument("--scheme", default="w4a16", choices=["none", "w8a16", "w4a16"], help="quant_matmul weights")
    parser.add_argument("--group-size", type=int, default=128, help="quant_matmul scale group, -1 per channel")
    parser.add_argument("--asymmetric", action="store_true", help="quant_matmul w4a16 with zero points")
    parser.add_argument("--experts", type=int, default=8, help="fused_moe experts")
    parser.add_argument("--top-k", type=int, default=2, help="fused_moe experts per token")
    return parser


def _no_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU visible to torch; Triton kernel timings need one (the interpreter's mean nothing)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install triton"
    return None


def check(args: argparse.Namespace, device: str) -> tuple[Inputs, int]:
    """Build the benchmark inputs and assert the kernel matches the reference on them.

    Returns (inputs, bytes one call must move at least). Raises AssertionError on a mismatch.
    """
    dtype = getattr(torch, args.dtype)
    inputs, nbytes = BUILDERS[args.kernel](dtype, device, args)
    kernel, reference = kernels.WRAPPERS[args.kernel], op_specs()[args.kernel].reference
    copies = [clone_inputs(inputs) for _ in range(2)]
    actual, expected = kernel(**copies[0]), reference(**copies[1])
    if args.kernel == "write_kv_cache":
        actual, expected = (copies[0]["k_cache"], copies[0]["v_cache"]), (copies[1]["k_cache"], copies[1]["v_cache"])
    assert_close(actual, expected, dtype)
    return inputs, nbytes


def main(argv: list[str] | None = None) -> int:
    """Check the kernel against the reference, then print both timings and GB/s. Returns the exit code."""
    args = build_parser().parse_args(argv)
    reason = _no_gpu_reason()
    if reason is not None:
        print(f"bench: {reason}", file=sys.stderr)
        return NO_GPU
    from triton.testing import do_bench

    inputs, nbytes = check(args, "cuda")
    print(f"{args.kernel} ({args.dtype}): matches the reference within tolerances")
    timed = [(name, lambda fn=fn: fn(**inputs))
             for name, fn in (("triton", kernels.WRAPPERS[args.kernel]),
                              ("torch reference", op_specs()[args.kernel].reference))]
    if args.kernel in BASELINES:
        name, build = BASELINES[args.kernel]
        timed.append((name, build(inputs)))
        print(f"  (GB/s for every row: the bytes the {args.kernel} kernel must move, over each one's time)")
    for name, run in timed:
        ms = do_bench(run)
        print(f"  {name:>18}: {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:8.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
