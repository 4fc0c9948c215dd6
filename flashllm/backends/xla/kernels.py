"""xla kernels: flashllm ops in plain torch that trace to one static-shape XLA graph.

Nothing here reads a tensor value on the host (.item(), .tolist(), nonzero, boolean-mask
indexing, Python loops over tensor values): each would stop the trace, run a partial graph and
make the step's graph depend on data. Shapes depend only on the (bucketed) input shapes, so a
decode step compiles once per bucket. No torch_xla import: these are torch ops on XLA tensors,
and they run (slowly, but correctly) on any device, which is how tests/unit checks them on CPU.

rms_norm, layer_norm, rotary_embedding, silu_and_mul, gelu_and_mul, the float quant_matmul and lora_shrink /
lora_expand are the op reference bodies, which are trace-friendly as written (only static shape checks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashllm.ops import op_specs
from flashllm.ops._kv_checks import reject_quantized_kv
from flashllm.ops.fused_moe import (
    EXPERT_SCHEMES,
    MOE_ACTIVATIONS,
    check_expert_biases,
    check_expert_scales,
    expert_activation,
    expert_weight,
)
from flashllm.ops.paged_attention import refuse_unclaimed
from flashllm.registry.backend import Backend, Caps

DTYPES = frozenset({torch.float32, torch.bfloat16})
# ops whose reference body has no host sync and no data-dependent shape
TRACEABLE_REFERENCES = ("rms_norm", "layer_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul", "quant_matmul",
                        "lora_shrink", "lora_expand")


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Scatter k, v (T, Hk, D) into their slots of the float caches (num_blocks, block_size, Hk, D).

    Padding tokens (slot -1) cannot be filtered out without a data-dependent shape, so every
    token writes: a padding token repeats the write of a real token of the batch (same slot,
    same value), which leaves the result independent of the scatter order; in a batch with no
    real token all tokens write slot 0's own contents back. Slots are not range-checked here (that
    would sync the device in every layer); the model runner only produces valid ones.
    """
    reject_quantized_kv("xla write_kv_cache", k_cache, k_scale, v_scale)
    src, slots, real = _padding_safe_slots(slot_mapping)
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache in ((k, k_cache), (v, v_cache)):
        values = torch.where(real[:, None, None], x.index_select(0, src).to(cache.dtype), cache[blocks, offsets])
        cache.index_put_((blocks, offsets), values)


def _padding_safe_slots(slot_mapping: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per token (T,): the token whose key/value it writes, the slot, and whether any token is real.

    A real token writes itself; a padding token writes the first real token's slot and value.
    """
    valid = slot_mapping >= 0
    token = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    first_real = torch.argmax(valid.to(torch.int32))  # 0 when there is none
    src = torch.where(valid, token, first_real)
    return src, slot_mapping.index_select(0, src).clamp(min=0), valid.index_select(0, src)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    alibi_slopes: Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Masked dense attention of every query token over its sequence's gathered paged context.

    q (T, Hq, D); block_tables (B, W); the cache is read as each token's dense context of
    L = W * block_size slots, (T, L, Hk, D), and keys past the token's position (or outside the
    sliding window) are masked. Work and memory are O(T * L): one graph for prefill, chunked
    prefill and decode alike, right for the bucketed batches of a TPU or the PJRT CPU client;
    long prefills want a ragged paged-attention kernel instead. Scores, softmax and the sum of V
    run in fp32; returns (T, Hq, D) in q.dtype. Rows past cu_seqlens_q[-1] (padding) attend to
    key 0 of the last sequence and are meaningless, as the op allows.
    """
    reject_quantized_kv("xla paged_attention", k_cache, k_scale, v_scale)
    refuse_unclaimed("xla", logit_softcap, sinks)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"paged_attention: sliding_window must be positive or None, got {sliding_window}")
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"paged_attention: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    seq_idx, q_pos = _token_positions(cu_seqlens_q, seq_lens, num_tokens)
    tables = block_tables.long().index_select(0, seq_idx)  # (T, W)
    k = k_cache[tables].flatten(1, 2).float()  # (T, L, Hk, D)
    v = v_cache[tables].flatten(1, 2).float()
    k_pos = torch.arange(k.shape[1], device=q.device)
    distance = q_pos[:, None] - k_pos[None, :]  # (T, L), >= 0 for keys at or before the query
    visible = distance >= 0
    if sliding_window is not None:
        visible = visible & (distance < sliding_window)
    group = num_heads // num_kv_heads
    # query head h reads KV head h // group: view the query heads as (Hk, group)
    qg = q.float().reshape(num_tokens, num_kv_heads, group, head_size)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, k).reshape(num_tokens, num_heads, -1) * scale
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[None, :, None] * (-distance).float()[:, None, :]
    # masked_fill, not an additive -inf: garbage in unused slots must not turn a row into NaN
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(num_tokens, num_kv_heads, group, -1)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, v)
    return out.reshape(num_tokens, num_heads, head_size).to(q.dtype)


def _token_positions(cu_seqlens_q: Tensor, seq_lens: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(seq_idx, q_pos), each (T,) int64: the sequence of each query token and its position in it.

    Token t belongs to the sequence b with cu[b] <= t < cu[b+1], i.e. b = #{ends <= t}; empty
    sequences are skipped by that count. Padding tokens past cu[-1] get the last sequence and
    position 0, so they see one key and stay finite.
    """
    ends = cu_seqlens_q[1:].long()  # (B,)
    token = torch.arange(num_tokens, device=cu_seqlens_q.device)
    seq_idx = (token[:, None] >= ends[None, :]).sum(dim=-1)  # (T,), B past the last real token
    real = seq_idx < ends.shape[0]
    seq_idx = seq_idx.clamp(max=ends.shape[0] - 1)
    # a sequence's q_len new tokens are its last ones: position = seq_len - (end - t)
    q_pos = seq_lens.long().index_select(0, seq_idx) - ends.index_select(0, seq_idx) + token
    return seq_idx, torch.where(real, q_pos, torch.zeros_like(q_pos))


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_scale: Tensor | None = None, w2_scale: Tensor | None = None, w13_bias: Tensor | None = None,
              w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    """Dense mixture of experts: every expert runs on every token, weighted 0 where not routed.

    Routing by gathering each expert's tokens has a data-dependent size; the dense form keeps
    one static graph at E times the FLOPs of the routed experts (what small MoE models on a
    PJRT device can afford). x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_weights (T, k),
    topk_ids (T, k) int64 in [0, E) (not range-checked: that would sync the device);
    math in fp32, returns (T, H) in x.dtype. w8a16 experts (int8 codes, w13_scale (E, 2I), w2_scale
    (E, H)) are dequantized one expert at a time inside the graph. Biases and the "swigluoai" activation
    (gpt-oss) as the op defines them.
    """
    check_expert_scales(w13, w2, w13_scale, w2_scale)
    check_expert_biases(w13, w2, w13_bias, w2_bias, activation)
    num_tokens, num_experts = x.shape[0], w13.shape[0]
    routing = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    routing = routing.scatter_add(1, topk_ids.long(), topk_weights.float())  # (T, E)
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(num_experts):  # E is a weight shape, not data: the loop unrolls into the graph
        gate_up = xf @ expert_weight(w13, w13_scale, expert).T
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        expert_out = expert_activation(gate_up, activation) @ expert_weight(w2, w2_scale, expert).T
        if w2_bias is not None:
            expert_out = expert_out + w2_bias[expert].float()
        out = out + routing[:, expert, None] * expert_out
    return out.to(x.dtype)


def register(backend: Backend) -> None:
    """Register the xla kernels on `backend`: fp32 and bf16, float KV caches, unquantized weights."""
    specs = op_specs()
    float_kv = Caps(DTYPES, kv_dtypes=DTYPES)
    backend.kernel("write_kv_cache", float_kv)(write_kv_cache)
    backend.kernel("paged_attention", Caps(DTYPES, kv_dtypes=DTYPES, alibi=True))(paged_attention)
    backend.kernel("fused_moe", Caps(DTYPES, quant=EXPERT_SCHEMES, moe_activations=MOE_ACTIVATIONS))(fused_moe)
    for op in TRACEABLE_REFERENCES:
        backend.kernel(op, Caps(DTYPES))(specs[op].reference)
