"""The fused decode step's mixture-of-experts layers: the C descriptors of csrc/moe_decode.c's block.

A MoE model (Mixtral, Qwen2-MoE, DeepSeek's routing too) declares its layers' MLPs as MoEWeights (registry/fusions.py);
decode_stack.py hands each such layer's descriptor to the same one native call as the attention,
so a decode step of a MoE model makes no per-op Python calls (the per-op path makes ~25 a MoE
layer: the router, softmax and top-k, each chosen expert's two products and activation, the
shared expert and its gate). The experts are fp32, or the fused_moe op's w8a16 / w4a16 codes,
which the block multiplies against fp32 activations exactly as the cpu fused_moe kernel's native
products do (backends/cpu/moe.py), or a GGUF file's blocks kept per expert (MoEWeights.expert_blocks),
each described as the dense layers are and multiplied as quant_matmul multiplies them; anything else keeps
the model's own forward.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flashllm.backends.cpu import moe, native
from flashllm.registry.fusions import LinearWeights, MoEWeights
from flashllm.registry.resolve import OpTable

_I64, _P = ctypes.c_int64, ctypes.c_void_p
_KINDS = {torch.float32: 0, torch.int8: 1, torch.uint8: 2}  # csrc/decode_stack.h's LINEAR_F32 / W8 / W4
# decode_stack.py's descriptor of one linear layer (its _linear): (layer, (N, K), keep) -> a stack_linear
DescribeLinear = Callable[[LinearWeights, tuple[int, int], list[Any]], ctypes.Structure]
MAX_GROUPS = 64  # csrc/moe_decode.c's MOE_MAX_GROUPS


class Unsupported(Exception):
    """A MoE layer the native block does not run as the ops would (the message says why)."""


class MoEBlock(ctypes.Structure):
    """csrc/moe_decode.c's stack_moe."""

    _fields_ = ([(name, _I64) for name in ("E", "k", "renormalize", "I", "kind", "G13", "G2")]
                + [(name, _P) for name in ("w13", "w2", "s13", "s2", "router", "shared_gate_up", "shared_down",
                                           "shared_gate", "scratch")]
                + [("max_tokens", _I64), ("H", _I64), ("sigmoid", _I64), ("n_group", _I64), ("topk_group", _I64),
                   ("bias", _P), ("scaling", ctypes.c_float), ("blocks13", _P), ("blocks2", _P)])


def _groups(weights: Tensor, scales: Tensor | None, what: str) -> int:
    """Scale groups per output row of (E, N, K) experts (K packed two a byte for int4), checked against
    what the native products take: groups of a multiple of native.GROUP_MULTIPLE input features."""
    if scales is None:
        return 1
    if not (scales.dtype == torch.float32 and scales.is_contiguous() and tuple(scales.shape[:2]) == weights.shape[:2]):
        raise Unsupported(f"{what} scales are not contiguous fp32 (E, N[, G])")
    groups = 1 if scales.dim() == 2 else scales.shape[2]
    features = weights.shape[2] * (2 if weights.dtype == torch.uint8 else 1)
    if features % groups or (features // groups) % native.GROUP_MULTIPLE:
        raise Unsupported(f"{what}: groups of {features // groups} features, not a multiple of {native.GROUP_MULTIPLE}")
    return groups


def describe(block: MoEWeights, hidden: int, ops: OpTable, keep: list[Any], linear: DescribeLinear) -> MoEBlock:
    """The C descriptor of one layer's MoE MLP on one rank, its router and shared expert described by
    `linear` (keeps what it points at alive); raises Unsupported for experts, routing or adapters the
    native block does not run as the ops would (see the module docstring)."""
    if block.expert_blocks is not None:
        return _describe_blocks(block, hidden, ops, keep, linear)
    if "fused_moe" not in ops.sources or ops.kernel("fused_moe").fn is not moe.fused_moe:
        raise Unsupported(f"op fused_moe runs {ops.sources.get('fused_moe')}'s kernel, not the cpu backend's")
    w13, w2 = block.w13, block.w2
    if block.experts_tp_size != 1 or w13.dim() != 3 or w2.dim() != 3 or w13.dtype != w2.dtype:
        raise Unsupported("experts split over ranks, or not stacked (E, N, K) of one dtype")
    if w13.dtype not in _KINDS or (w13.dtype == torch.float32) != (block.w13_scale is None):
        raise Unsupported(f"{w13.dtype} experts (the native block takes fp32, w8a16 and w4a16)")
    experts, packed = w13.shape[0], 2 if w13.dtype == torch.uint8 else 1
    inter = w2.shape[2] * packed
    if (tuple(w13.shape) != (experts, 2 * inter, hidden // packed) or tuple(w2.shape) != (experts, hidden, w2.shape[2])
            or not (w13.is_contiguous() and w2.is_contiguous()) or not 1 <= block.top_k <= experts):
        raise Unsupported(f"experts {tuple(w13.shape)} / {tuple(w2.shape)} for hidden {hidden}, "
                          f"or top-{block.top_k} of {experts}")
    desc = MoEBlock(E=experts, k=block.top_k, renormalize=int(block.renormalize), I=inter, kind=_KINDS[w13.dtype],
                    G13=_groups(w13, block.w13_scale, "w13"), G2=_groups(w2, block.w2_scale, "w2"),
                    w13=w13.data_ptr(), w2=w2.data_ptr(), H=hidden)
    _routing(desc, block, keep)
    desc.router = _pointer(linear(block.router, (experts, hidden), keep), keep)
    if w13.dtype == torch.int8 and (hidden % native.GROUP_MULTIPLE or inter % native.GROUP_MULTIPLE):
        raise Unsupported("int8 experts whose rows are not a multiple of 32 features")
    keep.extend((w13, w2))
    for name, scales in (("s13", block.w13_scale), ("s2", block.w2_scale)):
        if scales is not None:
            setattr(desc, name, scales.data_ptr())
            keep.append(scales)
    _shared(desc, block, hidden, keep, linear)
    return desc


def _describe_blocks(block: MoEWeights, hidden: int, ops: OpTable, keep: list[Any], linear: DescribeLinear) -> MoEBlock:
    """describe() for experts kept as blocks: one linear descriptor per expert and projection, built as the
    dense layers' are (`linear`: the products the per-op path's quant_matmul runs, int8 activations included)."""
    experts = block.num_experts
    if block.experts_tp_size != 1 or not experts or not 1 <= block.top_k <= experts:
        raise Unsupported("block experts split over ranks, or top-k outside the experts")
    inter = block.expert_blocks[0][1].weight.in_features
    w13 = [linear(pair[0], (2 * inter, hidden), keep) for pair in block.expert_blocks]
    w2 = [linear(pair[1], (hidden, inter), keep) for pair in block.expert_blocks]
    if any(d.lora for d in (*w13, *w2)):
        raise Unsupported("block experts with multi-LoRA slots (the block runs no adapters)")
    blocks13, blocks2 = (type(w13[0]) * experts)(*w13), (type(w2[0]) * experts)(*w2)
    keep.extend((blocks13, blocks2))
    desc = MoEBlock(E=experts, k=block.top_k, renormalize=int(block.renormalize), I=inter, kind=0, G13=1, G2=1,
                    H=hidden, blocks13=ctypes.addressof(blocks13), blocks2=ctypes.addressof(blocks2))
    _routing(desc, block, keep)
    desc.router = _pointer(linear(block.router, (experts, hidden), keep), keep)
    _shared(desc, block, hidden, keep, linear)
    return desc


def _shared(desc: MoEBlock, block: MoEWeights, hidden: int, keep: list[Any], linear: DescribeLinear) -> None:
    """The shared expert's and its gate's descriptors, where the layer has them."""
    shared = (block.shared_gate_up, block.shared_down)
    if any(part is not None for part in (*shared, block.shared_gate)):
        if any(part is None or part.weight is None for part in shared):
            raise Unsupported("a shared expert without its gate_up or down")
        shared_inter = shared[1].weight.in_features
        desc.shared_gate_up = _pointer(linear(shared[0], (2 * shared_inter, hidden), keep), keep)
        desc.shared_down = _pointer(linear(shared[1], (hidden, shared_inter), keep), keep)
        if block.shared_gate is not None:  # None: the shared expert is added unscaled (DeepSeek)
            desc.shared_gate = _pointer(linear(block.shared_gate, (1, hidden), keep), keep)


def _routing(desc: MoEBlock, block: MoEWeights, keep: list[Any]) -> None:
    """DeepSeek's routing fields of the descriptor (MoEWeights' scoring, bias, groups and scaling), checked."""
    experts = block.num_experts
    if block.scoring not in ("softmax", "sigmoid"):
        raise Unsupported(f"{block.scoring!r} expert scores (the native block takes softmax and sigmoid)")
    groups, kept = block.n_group, block.topk_group
    if not (1 <= groups <= MAX_GROUPS and experts % groups == 0 and 1 <= kept <= groups
            and block.top_k <= kept * (experts // groups)):
        raise Unsupported(f"{groups} expert groups ({kept} kept) for {experts} experts, top-{block.top_k}")
    bias = block.correction_bias
    if bias is not None:
        if not (bias.dtype == torch.float32 and bias.is_contiguous() and tuple(bias.shape) == (experts,)):
            raise Unsupported("a correction bias that is not fp32 (E,)")
        desc.bias = bias.data_ptr()
        keep.append(bias)
    desc.sigmoid, desc.n_group, desc.topk_group = int(block.scoring == "sigmoid"), groups, kept
    desc.scaling = block.routed_scaling_factor


def _pointer(desc: ctypes.Structure, keep: list[Any]) -> int:
    """The address of a linear layer's descriptor, refused where it carries LoRA adapter slots (the
    block adds no adapter deltas), the descriptor kept alive."""
    if getattr(desc, "lora", None):
        raise Unsupported("a MoE layer's router or shared expert with multi-LoRA slots (the block runs no adapters)")
    keep.append(desc)
    return ctypes.addressof(desc)


def attach_scratch(blocks: list[MoEBlock]) -> Tensor:
    """One scratch buffer for every block (the layers run one after another) of native.MAX_TOKENS
    tokens; returns it (the caller keeps it alive)."""
    lib = native.library()
    floats = max(lib.flashllm_moe_scratch(ctypes.addressof(b), native.MAX_TOKENS) for b in blocks)
    scratch = torch.empty(floats, dtype=torch.float32)
    for block in blocks:
        block.scratch, block.max_tokens = scratch.data_ptr(), native.MAX_TOKENS
    return scratch


class _Sizes(ctypes.Structure):
    """csrc/decode_stack.h's moe_sizes."""

    _fields_ = [("T", _I64), ("H", _I64), ("threads", ctypes.c_int), ("split_elements", _I64), ("silu_split", _I64)]


def run_block(desc: MoEBlock, x: Tensor) -> Tensor:
    """The native block on fp32 x (T, H), T <= desc.max_tokens (attach_scratch first) -> (T, H) fp32,
    as a decode step runs it: with the step's threads and split thresholds (tests and benches)."""
    from flashllm.backends.cpu import native_ops, parallel

    tokens = x.shape[0]
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == desc.H and 1 <= tokens <= desc.max_tokens):
        raise ValueError(f"run_block takes fp32 (T, {desc.H}) with 1 <= T <= {desc.max_tokens}; got {x.dtype} "
                         f"{tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    sizes = _Sizes(T=tokens, H=desc.H, threads=parallel.workers(), split_elements=native.SPLIT_MIN_ELEMENTS,
                   silu_split=native_ops.SILU_SPLIT_ELEMENTS)
    native.library().flashllm_moe_block(ctypes.addressof(desc), ctypes.addressof(sizes), x.data_ptr(), out.data_ptr())
    return out
