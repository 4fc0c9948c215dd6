"""Inputs of the kernel benchmark: one builder per op, at the shape the parsed flags describe.

A builder returns (inputs, bytes): the op's keyword arguments on `device`, and the fewest bytes one
call must move (each input read once, each output written once), which GB/s figures divide.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

Inputs = dict[str, Any]


def _randn(*shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)


def _norm_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, h = args.tokens, args.hidden
    inputs = {"x": _randn(t, h, dtype=dtype, device=device), "weight": _randn(h, dtype=dtype, device=device),
              "eps": 1e-6, "residual": _randn(t, h, dtype=dtype, device=device)}
    return inputs, (4 * t * h + h) * dtype.itemsize  # read x, residual, weight; write out, residual


def _layer_norm_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    inputs, nbytes = _norm_inputs(dtype, device, args)
    inputs.update(bias=_randn(args.hidden, dtype=dtype, device=device), eps=1e-5)
    return inputs, nbytes + args.hidden * dtype.itemsize  # and the bias


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


def _attention_batch(args: argparse.Namespace) -> tuple[int, int]:
    """(sequences, new tokens each): decode has --seqs of 1; prefill --tokens in sequences of
    --context keys whose first --num-cached-tokens are already cached."""
    if args.mode == "decode":
        return args.seqs, 1
    q_len = args.context - args.num_cached_tokens
    return max(args.tokens // q_len, 1), q_len


def _attention_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    seqs, q_len = _attention_batch(args)
    inputs, kv_bytes = _paged(dtype, device, seqs, args.context, args)
    inputs.update(
        q=_randn(seqs * q_len, args.heads, args.head_size, dtype=dtype, device=device),
        cu_seqlens_q=torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((seqs,), args.context, dtype=torch.int32, device=device),
        scale=args.head_size**-0.5,
    )
    return inputs, kv_bytes + 2 * seqs * q_len * args.heads * args.head_size * dtype.itemsize


def _latent_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    """MLA at DeepSeek's proportions for --head-size D: kv_lora_rank 4D, rope D/2, nope and value heads D
    (D = 128: V2/V3's 512 + 64 latent row); --heads query heads over --seqs x --context cached tokens."""
    seqs, q_len = _attention_batch(args)
    d, bs, heads = args.head_size, args.block_size, args.heads
    rank, rope = 4 * d, d // 2
    per_seq = -(-args.context // bs)
    tables = torch.randperm(seqs * per_seq, device=device).view(seqs, per_seq).to(torch.int32)
    positions = torch.arange(args.context - q_len, args.context, device=device)
    slots = (tables.long()[:, positions // bs] * bs + positions % bs).flatten()
    t = seqs * q_len
    inputs = {
        "q": _randn(t, heads, d + rope, dtype=dtype, device=device),
        "latent": _randn(t, rank + rope, dtype=dtype, device=device),
        "kv_cache": _randn(seqs * per_seq, bs, rank + rope, dtype=dtype, device=device),
        "kv_b_weight": _randn(heads, 2 * d, rank, dtype=dtype, device=device) * rank**-0.5,
        "slot_mapping": slots, "block_tables": tables,
        "cu_seqlens_q": torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device),
        "seq_lens": torch.full((seqs,), args.context, dtype=torch.int32, device=device),
        "scale": (d + rope) ** -0.5,
    }
    cache_bytes = seqs * args.context * (rank + rope) * dtype.itemsize
    return inputs, cache_bytes + (heads * 2 * d * rank + t * heads * (2 * d + rope)) * dtype.itemsize


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


LORA_RANK, LORA_SLOTS = 16, 4  # the shape multi-LoRA serving runs at: rank-16 adapters, 4 slots, rows spread over them


def _lora_indices(tokens: int, device: str) -> torch.Tensor:
    return (torch.arange(tokens, device=device) % (LORA_SLOTS + 1) - 1).to(torch.int64)  # -1, 0, 1, .. per row


def _lora_shrink_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, k = args.tokens, args.hidden
    inputs = {"x": _randn(t, k, dtype=dtype, device=device),
              "lora_a": _randn(LORA_SLOTS, LORA_RANK, k, dtype=dtype, device=device) * k**-0.5,
              "lora_indices": _lora_indices(t, device)}
    return inputs, (LORA_SLOTS * LORA_RANK * k + t * k + t * LORA_RANK) * dtype.itemsize


def _lora_expand_inputs(dtype: torch.dtype, device: str, args: argparse.Namespace) -> tuple[Inputs, int]:
    t, n = args.tokens, args.out_features
    inputs = {"out": _randn(t, n, dtype=dtype, device=device), "h": _randn(t, LORA_RANK, dtype=dtype, device=device),
              "lora_b": _randn(LORA_SLOTS, n, LORA_RANK, dtype=dtype, device=device) * LORA_RANK**-0.5,
              "lora_indices": _lora_indices(t, device), "offset": 0}
    return inputs, (LORA_SLOTS * LORA_RANK * n + 2 * t * n + t * LORA_RANK) * dtype.itemsize


def _contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """(num_blocks, block_size, Hk, D) paged cache -> (seqs, Hk, context, D) contiguous, in block-table order."""
    return cache[block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


BUILDERS: dict[str, Callable[[torch.dtype, str, argparse.Namespace], tuple[Inputs, int]]] = {
    "rms_norm": _norm_inputs,
    "layer_norm": _layer_norm_inputs,
    "silu_and_mul": _gated_inputs,
    "gelu_and_mul": _gated_inputs,
    "rotary_embedding": _rotary_inputs,
    "write_kv_cache": _write_kv_inputs,
    "paged_attention": _attention_inputs,
    "quant_matmul": _quant_matmul_inputs,
    "fused_moe": _fused_moe_inputs,
    "lora_shrink": _lora_shrink_inputs,
    "lora_expand": _lora_expand_inputs,
    "latent_attention": _latent_inputs,
}


