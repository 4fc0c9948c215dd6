"""Micro-benchmark of one Triton kernel against its op's PyTorch reference, after a correctness check.

    python -m flashllm.backends.cuda.bench --kernel paged_attention --mode decode --dtype bfloat16

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


BUILDERS: dict[str, Callable[[torch.dtype, str, argparse.Namespace], tuple[Inputs, int]]] = {
    "rms_norm": _norm_inputs,
    "silu_and_mul": _gated_inputs,
    "gelu_and_mul": _gated_inputs,
    "rotary_embedding": _rotary_inputs,
    "write_kv_cache": _write_kv_inputs,
    "paged_attention": _attention_inputs,
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
    for name, fn in (("triton", kernels.WRAPPERS[args.kernel]), ("torch reference", op_specs()[args.kernel].reference)):
        ms = do_bench(lambda fn=fn: fn(**inputs))
        print(f"  {name:>16}: {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:8.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
