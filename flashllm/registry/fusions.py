"""Fusions a model declares: plain records of the weights and geometry a backend's fused fast paths read.

A backend may run part of a model as one fused call (the cpu backend runs a decode step's whole
decoder stack in one native call, and a greedy step's LM head from a smaller copy of its rows).
Such a path must know exactly what the model computes, so the model says so: `model.fusions()`
returns a mapping from a fusion's name (DECODER_STACK, LM_HEAD) to one of the records below. A
record holds tensors and values, never modules, so a backend reads it without importing a model
class or touching a layer's attributes. A model declares a fusion only where the record describes
its computation exactly; one whose blocks differ (another norm, activation, residual wiring, a
per-layer rotary table) leaves it out or declares what differs, and the fast path refuses it. A
backend checks every field it relies on and falls back to the model's own forward otherwise.

The records are read after loading (`process_weights_after_loading` has built each linear layer's
QuantizedWeight) and describe this rank's shard; a backend builds its fused path from them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.registry.resolve import OpTable

DECODER_STACK = "decoder_stack"
LM_HEAD = "lm_head"

_Record = TypeVar("_Record")


@dataclass(frozen=True, slots=True)
class LoRASlots:
    """A linear layer's multi-LoRA adapter slots (flashllm/models/layers/lora.py's LinearLoRA), the
    live tables: adapters load into them in place while the record stands.

    With slot i, a row x adds, for each shard s, B_s[i] @ (A[i] @ x)[s * rank:(s + 1) * rank] to the
    output columns [offsets[s], offsets[s] + B_s.shape[1]); slot -1 adds nothing.
    lora_a: (max_loras, S * rank, in_features); lora_b: S tensors (max_loras, rows_s, rank), the LoRA
    scale folded in; smaller ranks zero-padded.
    """

    lora_a: Tensor
    lora_b: tuple[Tensor, ...]
    offsets: tuple[int, ...]
    rank: int

    @classmethod
    def of(cls, table: Any) -> LoRASlots:
        """The record of a slot table holding `lora_a`, `lora_b`, `shards` ((offset, rows) each) and `max_rank`."""
        return cls(table.lora_a, tuple(table.lora_b), tuple(offset for offset, _ in table.shards), table.max_rank)


@dataclass(frozen=True, slots=True)
class LinearWeights:
    """One linear layer on this rank: y = x @ W.T + b through the quant_matmul op, plus each row's
    adapter delta where the layer has multi-LoRA slots.

    weight: what quant_matmul multiplies by, (out_features, in_features) in its scheme; None before
      the model's weights were processed after loading.
    bias: (out_features,) or None.
    tp_size: the ranks the layer is split over (1: whole on this rank).
    lora: the layer's adapter slots, or None (no multi-LoRA); a fast path that does not apply them
      must not take a step with adapter rows.
    """

    weight: QuantizedWeight | None
    bias: Tensor | None
    tp_size: int
    lora: LoRASlots | None = None

    @classmethod
    def of(cls, layer: Any) -> LinearWeights:
        """The record of a linear layer holding `qweight`, `bias` (a parameter or None), `tp_size` and,
        with multi-LoRA, `lora` (its slot table)."""
        table = getattr(layer, "lora", None)
        return cls(layer.qweight, None if layer.bias is None else layer.bias.data, layer.tp_size,
                   None if table is None else LoRASlots.of(table))


@dataclass(frozen=True, slots=True)
class RMSNormWeights:
    """An RMSNorm through the rms_norm op: x / sqrt(mean(x^2) + eps) * weight, weight (hidden_size,)."""

    weight: Tensor
    eps: float

    @classmethod
    def of(cls, norm: Any) -> RMSNormWeights:
        """The record of an RMSNorm module holding `weight` (a parameter) and `eps`."""
        return cls(norm.weight.data, norm.eps)


@dataclass(frozen=True, slots=True)
class MoEWeights:
    """A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE) in place of a block's dense one:

        probs = softmax(router(h)) in fp32 over the E experts
        weights, ids = topk(probs, top_k)          # divided by their sum when renormalize
        out = fused_moe(h, w13, w2, weights, ids, w13_scale, w2_scale)
        out += sigmoid(shared_gate(h)) * shared_down(silu_and_mul(shared_gate_up(h)))   # with a shared expert

    router: (E, hidden) in the model dtype. w13 (E, 2I, hidden) gate rows then up rows, w2 (E, hidden,
    I), with scales as the fused_moe op takes them (flashllm.ops.fused_moe: None for float experts,
    (E, N) for w8a16, (E, N, G) for w4a16). shared_gate_up / shared_down / shared_gate ((1, hidden)):
    the shared expert and its gate, all three None without one; shared_gate alone None: the shared
    expert's output is added unscaled (DeepSeek). experts_tp_size: the ranks the experts'
    intermediate features are split over (1: whole on this rank). expert_blocks: the experts as one
    (w13 (2I, hidden), w2 (hidden, I)) linear pair each, run through quant_matmul (a GGUF file's blocks,
    FusedMoE.use_expert_blocks), with w13, w2 and their scales None; None: the stacked tensors above.

    DeepSeek's routing (flashllm/models/deepseek_moe.py select_experts_grouped) changes the first two
    lines: scoring "sigmoid" takes sigmoid(router(h)) as the scores; a correction_bias ((E,) fp32, or None;
    with either scoring: ERNIE 4.5 adds one to softmax probabilities) chooses by scores + bias while the
    weights are the scores; with n_group > 1 the k are
    chosen within the topk_group best of n_group equal groups of experts (a group's score: its best
    expert's for softmax, its best two's sum for sigmoid); the k weights (renormalized or not) are
    then multiplied by routed_scaling_factor.
    """

    router: LinearWeights
    top_k: int
    renormalize: bool
    w13: Tensor | None
    w2: Tensor | None
    w13_scale: Tensor | None
    w2_scale: Tensor | None
    experts_tp_size: int
    shared_gate_up: LinearWeights | None
    shared_down: LinearWeights | None
    shared_gate: LinearWeights | None
    scoring: str = "softmax"
    correction_bias: Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    expert_blocks: tuple[tuple[LinearWeights, LinearWeights], ...] | None = None

    @property
    def num_experts(self) -> int:
        """E: the experts' count, stacked or as blocks."""
        return len(self.expert_blocks) if self.expert_blocks is not None else self.w13.shape[0]


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """DeepSeek's multi-head latent attention in place of a block's attention (flashllm/models/deepseek.py):

        q = q_b_proj(q_a_layernorm(q_a_proj(h)))   # or q_proj(h) where q_a_proj is None; (T, heads, Dn + R)
        c = kv_a_proj(h)                            # (T, L + R)
        row = (kv_a_layernorm(c[:, :L]), rotate(c[:, L:]))   # the token's latent cache row, written at its slot
        rotate q[..., Dn:] with the stack's rotary table (rotary_dim R)
        h = o_proj(latent_attention(q, cache, kv_b, scale))  # absorbed: W_UK folded into q, W_UV after

    kv_b: (heads, Dn + Dv, L) in the model dtype, each head's W_UK rows then its W_UV rows.
    eps: the two norms'. q_a_layernorm: None where q_a_proj is.
    """

    q_a_proj: LinearWeights | None
    q_a_layernorm: RMSNormWeights | None
    q_b_proj: LinearWeights
    kv_a_proj: LinearWeights
    kv_a_layernorm: RMSNormWeights
    kv_b: Tensor
    o_proj: LinearWeights
    nope_dim: int
    rope_dim: int
    latent_dim: int
    v_dim: int


@dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    """One standard pre-norm decoder block, the residual add fused into its norms:

        h, residual = input_layernorm(x, residual)
        q, k, v = split(qkv_proj(h))              # num_heads, num_kv_heads, num_kv_heads heads of head_dim
        q, k = q_norm(q), k_norm(k)               # each head over head_dim, where set (Qwen3)
        q, k = rotary_embedding(positions, q, k)   # the stack's shared table
        h = o_proj(paged_attention(q, k, v))       # after write_kv_cache; causal, sliding_window if set
        h, residual = post_attention_layernorm(h, residual)
        out = down_proj(activation_and_mul(gate_up_proj(h)))   # gate_up rows: (gate | up)

    sliding_window: this layer's attention window in tokens, or None for full attention.
    moe: where set, the block's MLP is this mixture of experts instead, and gate_up_proj and
    down_proj are None.
    mla: where set, the block's attention is this latent attention instead (one cache a layer),
    qkv_proj is None and o_proj is mla.o_proj.
    q_norm, k_norm: where set, RMSNorms of (head_dim,) applied to every query / key head before the
    rotary embedding; a backend that fuses the stack must apply them or decline the stack.
    """

    input_layernorm: RMSNormWeights
    post_attention_layernorm: RMSNormWeights
    qkv_proj: LinearWeights | None
    o_proj: LinearWeights
    gate_up_proj: LinearWeights | None
    down_proj: LinearWeights | None
    sliding_window: int | None
    moe: MoEWeights | None = None
    mla: MLAWeights | None = None
    q_norm: RMSNormWeights | None = None
    k_norm: RMSNormWeights | None = None


@dataclass(frozen=True, slots=True)
class RotaryTable:
    """The rotary embedding every layer shares: cos_sin_cache (max_position, rotary_dim) fp32 rows of
    [cos | sin] by position; the first rotary_dim features of each head rotate, in GPT-NeoX halves
    when is_neox, else interleaved pairs."""

    cos_sin_cache: Tensor
    rotary_dim: int
    is_neox: bool


@dataclass(frozen=True, slots=True)
class DecoderStackFusion:
    """The decoder stack from token ids to final hidden states, as DECODER_STACK declares it:

        x = embed_tokens[input_ids]                # a plain row lookup of this rank's table
        for layer in layers: x, residual = layer(x, residual)   # see DecoderLayerWeights
        hidden, _ = norm(x, residual)

    Every layer shares the attention geometry on this rank: num_heads query heads, num_kv_heads
    KV heads (num_heads a multiple of it), head_dim, softmax `scale` (latent attention stacks: one
    KV head of head_dim L + R, the cache row); its MLP's activation
    ("silu": SwiGLU, the experts' too) over intermediate_size features (the dense layers').
    embed_tokens: (V_p, hidden_size), the vocabulary rows of this rank (embed_tp_size ranks hold one
    part each). ops: the op table the layers were built with, which says which backend's kernel
    each op resolved to (ops.sources, ops.kernel), so a fast path can stand in only for the kernels
    it reproduces.
    """

    layers: tuple[DecoderLayerWeights, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    intermediate_size: int
    activation: str
    rotary: RotaryTable
    embed_tokens: Tensor
    embed_tp_size: int
    norm: RMSNormWeights
    ops: OpTable


@dataclass(frozen=True, slots=True)
class LMHeadFusion:
    """The LM head as LM_HEAD declares it: the model's compute_logits(hidden) is exactly
    quant_matmul(hidden, qweight)[:, :vocab_size] (gathered over tp_size ranks) / logits_scale,
    nothing else after it.

    weight: the head's float rows on this rank, (V_p, hidden_size); the input embedding's table when
      tied. qweight: what the head multiplies by (scheme "none": weight itself; "w8a16" for a
      quantized head), None before loading; its kernel_cache is where a backend keeps a re-layout
      of the head it builds once (a smaller copy for a faster argmax, say), which lives as long as the head.
    logits_scale: a finite positive divisor of the product (Granite's logits_scaling; 1.0: none). A path
      that returns logits or logprobs must divide by it; one that returns only the argmax of the product
      may skip it where the division cannot tie two distinct logits (a power of two: exact for normal
      results), and must decline the head otherwise.
    """

    weight: Tensor
    qweight: QuantizedWeight | None
    vocab_size: int
    tp_size: int
    tied: bool
    logits_scale: float = 1.0


def declared(model: object, name: str, record: type[_Record], keeps_taps: bool = False) -> _Record | None:
    """The fusion `name` that `model.fusions()` declares, or None where it declares none (a model
    without a fusions() method declares none). DECODER_STACK is also None while a drafter taps the
    model's stack (models/llama.py HiddenTaps), unless the asking path says it `keeps_taps`.

    Raises TypeError where the model declares something other than a `record` under that name: the
    model's fusions() is wrong, and a fast path must not guess what it meant.
    """
    if name == DECODER_STACK and not keeps_taps and getattr(getattr(model, "model", None), "hidden_taps", None):
        return None
    fusions = getattr(model, "fusions", None)
    found = fusions().get(name) if callable(fusions) else None
    if found is not None and not isinstance(found, record):
        raise TypeError(f"{type(model).__name__}.fusions()[{name!r}] is a {type(found).__name__}; expected a "
                        f"{record.__name__} (flashllm.registry.fusions), or no entry where the model offers none")
    return found
