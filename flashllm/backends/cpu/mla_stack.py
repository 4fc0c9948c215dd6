"""The fused decode step's latent attention layers (DeepSeek's MLA): the C descriptors of csrc/mla_decode.c's block.

A DeepSeek model declares each layer's attention as MLAWeights (registry/fusions.py); decode_stack.py
hands the descriptor to the same one native call as the rest of the stack, so a decode step makes
no per-op Python calls (the per-op path makes ~40 a layer between the projections, the two norms,
the rotary, the cache write and latent_attention's own wrappers). The block runs the absorbed form
only, as latent_attention does for decode (backends/cpu/mla.py): with --mla_use_matrix_absorption
off the model keeps its own forward.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from flashllm.backends.cpu import mla, native
from flashllm.backends.cpu.moe_stack import DescribeLinear
from flashllm.registry.fusions import MLAWeights
from flashllm.registry.resolve import OpTable

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class Unsupported(Exception):
    """An MLA layer the native block does not run as the ops would (the message says why)."""


class MLABlock(ctypes.Structure):
    """csrc/mla_decode.c's stack_mla."""

    _fields_ = ([(name, _I64) for name in ("Hq", "Dn", "R", "L", "Dv", "Q")] + [("eps", ctypes.c_float)]
                + [(name, _P) for name in ("q_a", "q_b", "q_norm", "kv_a", "kv_norm", "kv_b", "o", "scratch")]
                + [("max_tokens", _I64), ("H", _I64)])


def _pointer(desc: ctypes.Structure, keep: list[Any]) -> int:
    """The address of a linear layer's descriptor, refused where it carries LoRA adapter slots."""
    if getattr(desc, "lora", None):
        raise Unsupported("an MLA projection with multi-LoRA slots (the block runs no adapters)")
    keep.append(desc)
    return ctypes.addressof(desc)


def _norm(weight: torch.Tensor, size: int, keep: list[Any]) -> int:
    if not (weight.dtype == torch.float32 and weight.is_contiguous() and tuple(weight.shape) == (size,)):
        raise Unsupported(f"an MLA norm weight that is not fp32 ({size},)")
    keep.append(weight)
    return weight.data_ptr()


def describe(block: MLAWeights, hidden: int, heads: int, rotary_dim: int, ops: OpTable, keep: list[Any],
             linear: DescribeLinear) -> MLABlock:
    """The C descriptor of one layer's latent attention on one rank (`heads` query heads, the stack's
    rotary table of `rotary_dim` columns), its projections described by `linear` (keeps what it points
    at alive); raises Unsupported where the block would not compute what the ops compute."""
    if "latent_attention" not in ops.sources or ops.kernel("latent_attention").fn is not mla.latent_attention:
        raise Unsupported(f"op latent_attention runs {ops.sources.get('latent_attention')}'s kernel, not the cpu's")
    nope, rope, rank, dv = block.nope_dim, block.rope_dim, block.latent_dim, block.v_dim
    if rope != rotary_dim or rope % 2:
        raise Unsupported(f"a rope part of {rope} features against a rotary table of {rotary_dim}")
    kv_b = block.kv_b
    if not (kv_b.dtype == torch.float32 and kv_b.is_contiguous() and tuple(kv_b.shape) == (heads, nope + dv, rank)):
        raise Unsupported(f"kv_b {kv_b.dtype} {tuple(kv_b.shape)}: expected contiguous fp32 "
                          f"{(heads, nope + dv, rank)}")
    norms = [block.kv_a_layernorm] + ([block.q_a_layernorm] if block.q_a_layernorm is not None else [])
    if len({n.eps for n in norms}) != 1:
        raise Unsupported("the q_a and kv_a norms have different eps")
    desc = MLABlock(Hq=heads, Dn=nope, R=rope, L=rank, Dv=dv, eps=norms[0].eps, H=hidden,
                    kv_b=kv_b.data_ptr(), kv_norm=_norm(block.kv_a_layernorm.weight, rank, keep))
    keep.append(kv_b)
    queries = heads * (nope + rope)
    if block.q_a_proj is not None:
        if block.q_a_layernorm is None or block.q_a_proj.weight is None:
            raise Unsupported("a q_a_proj without its norm")
        q_rank = block.q_a_proj.weight.out_features
        desc.Q = q_rank
        desc.q_a = _pointer(linear(block.q_a_proj, (q_rank, hidden), keep), keep)
        desc.q_norm = _norm(block.q_a_layernorm.weight, q_rank, keep)
        desc.q_b = _pointer(linear(block.q_b_proj, (queries, q_rank), keep), keep)
    else:
        desc.q_b = _pointer(linear(block.q_b_proj, (queries, hidden), keep), keep)
    desc.kv_a = _pointer(linear(block.kv_a_proj, (rank + rope, hidden), keep), keep)
    desc.o = _pointer(linear(block.o_proj, (hidden, heads * dv), keep), keep)
    return desc


def attach_scratch(blocks: list[MLABlock]) -> torch.Tensor:
    """One scratch buffer for every block (the layers run one after another) of native.MAX_TOKENS
    tokens; returns it (the caller keeps it alive)."""
    lib = native.library()
    floats = max(lib.flashllm_mla_scratch(ctypes.addressof(b), native.MAX_TOKENS) for b in blocks)
    scratch = torch.empty(floats, dtype=torch.float32)
    for block in blocks:
        block.scratch, block.max_tokens = scratch.data_ptr(), native.MAX_TOKENS
    return scratch

