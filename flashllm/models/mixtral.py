"""Mixtral decoder: Llama's attention with a sparse mixture-of-experts MLP in every layer (and the MoE
stack Qwen2-MoE reuses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.hf_config import ModelLoadError, positive_int
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import FusedMoE, RouterLinear, SparseMoeBlock, expert_param_target, with_fused_experts
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.packed_experts import dequantized_experts
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import (
    HiddenTaps,
    LlamaAttention,
    LlamaModel,
    head_norms,
    plain_head_norms,
    run_decoder_stack,
)
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.registry.fusions import (
    DECODER_STACK,
    LM_HEAD,
    DecoderLayerWeights,
    DecoderStackFusion,
    LinearWeights,
    LMHeadFusion,
    MoEWeights,
    RMSNormWeights,
    RotaryTable,
)

# More experts than this is not a model flashllm could run; refused before allocating.
MAX_NUM_EXPERTS = 4096


@dataclass(frozen=True, slots=True)
class MoEModelConfig(LlamaModelConfig):
    """A Llama-family config.json with a mixture-of-experts MLP, validated.

    num_experts: routed experts per MoE layer; num_experts_per_tok: experts each token goes to (k);
    moe_intermediate_size: each expert's intermediate features; shared_expert_intermediate_size:
    the always-on shared expert's (0: none); norm_topk_prob: whether the k routing weights are
    renormalized to sum to one; sparse_layers[i]: whether layer i is MoE (else a dense gated MLP of
    intermediate_size); qkv_bias: the q, k and v projections carry a bias.
    """

    num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 1
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()
    qkv_bias: bool = False
    # --enable-expert-parallel: the MoE layers' ranks hold whole experts (models/layers/moe.py FusedMoE)
    expert_parallel: bool = False

    @property
    def num_parameters(self) -> int:
        """Every weight: attention, experts, routers, shared experts, dense MLPs, embedding and LM head."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        moe = (self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
               + 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0))
        dense = 3 * h * self.intermediate_size
        mlps = sum(moe if sparse else dense for sparse in self.sparse_layers)
        return self.num_hidden_layers * attn + mlps + 2 * self.vocab_size * h


def moe_config(base: LlamaModelConfig, cls: type[MoEModelConfig] = MoEModelConfig, **moe_fields: Any) -> Any:
    """`base`'s fields plus the MoE ones, as a MoEModelConfig (or the subclass `cls`)."""
    return cls(**{f.name: getattr(base, f.name) for f in fields(LlamaModelConfig)}, **moe_fields)


def experts_and_top_k(raw: dict[str, Any], experts_field: str, default_experts: int, default_top_k: int,
                      source: str) -> tuple[int, int]:
    """(num experts, num_experts_per_tok) from config.json, refusing k past the number of experts."""
    num_experts = positive_int(raw, experts_field, default_experts, MAX_NUM_EXPERTS, source)
    top_k = positive_int(raw, "num_experts_per_tok", default_top_k, MAX_NUM_EXPERTS, source)
    if top_k > num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={top_k} exceeds {experts_field}={num_experts}; "
                             "a token cannot go to more experts than the layer has")
    return num_experts, top_k


def check_prequantized_experts(config: MoEModelConfig, source: str) -> None:
    """A GPTQ / AWQ checkpoint's groups must tile the experts' input features too (hidden_size is checked
    with the dense layers'): one line naming the field, before anything is allocated."""
    quant = config.quantization
    if quant is None or quant.group_size == -1:
        return
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(config, field)
        if size % quant.group_size:
            raise ModelLoadError(f"{source}: quantization_config group_size={quant.group_size} does not divide "
                                 f"{field}={size}; each group must lie within one expert projection's inputs")


def every_layer_sparse(base: LlamaModelConfig, raw: dict[str, Any], default_experts: int, default_top_k: int,
                       source: str, cls: type[MoEModelConfig] = MoEModelConfig, **fields: Any) -> Any:
    """`base` as Mixtral's kind of MoE config (or `cls`'s, with its own `fields`): num_local_experts and
    num_experts_per_tok from config.json (these defaults where absent), every layer sparse with experts
    intermediate_size wide, the top-k weights renormalized, no shared expert."""
    num_experts, top_k = experts_and_top_k(raw, "num_local_experts", default_experts, default_top_k, source)
    return moe_config(base, cls, num_experts=num_experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=base.intermediate_size, norm_topk_prob=True,
                      sparse_layers=(True,) * base.num_hidden_layers, **fields)


def parse_mixtral_config(raw: dict[str, Any], source: str = "config.json") -> MoEModelConfig:
    """Validate a Mixtral config.json: Llama's fields, num_local_experts and num_experts_per_tok (defaults
    8 and 2, as transformers'); every layer is MoE with intermediate_size features per expert, the
    top-k weights always renormalized, no shared expert. Raises ModelLoadError (one line)."""
    config = every_layer_sparse(parse_llama_config(raw, source), raw, 8, 2, source, qkv_bias=False)
    check_prequantized_experts(config, source)
    return config


class MoEDecoderLayer(PreNormBlock):
    """Llama's pre-norm block with the MLP given (a SparseMoeBlock, or a dense GatedMLP): x + attn(norm(x)),
    then + mlp(norm(.)), the residual add fused in the norms."""

    def __init__(self, config: MoEModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, mlp: nn.Module,
                 ops: Any, dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1, attention_class: type[LlamaAttention] = LlamaAttention,
                 norm_class: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = attention_class(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias,
                                         tp_rank, tp_size)
        self.mlp = mlp
        self.input_layernorm = norm_class(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = norm_class(config.hidden_size, config.rms_norm_eps, ops, dtype, device)



# (config, layer index) -> that layer's MLP module
MakeMLP = Callable[[MoEModelConfig, int], nn.Module]


class MoEModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix); layer i's MLP from make_mlp. A subclass may
    set another `norm_class` for every norm (PhiMoE's LayerNorm) and build its own rotary table (build_rotary)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    norm_class: ClassVar[type[nn.Module]] = RMSNorm
    build_rotary = staticmethod(LlamaModel.build_rotary)

    def __init__(self, config: MoEModelConfig, make_mlp: MakeMLP, ops: Any, dtype: torch.dtype, device: torch.device,
                 qkv_bias: bool, o_bias: bool, tp_rank: int = 0, tp_size: int = 1,
                 attention_class: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = self.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            MoEDecoderLayer(config, i, self.rotary_emb, make_mlp(config, i), ops, dtype, device, qkv_bias, o_bias,
                            tp_rank, tp_size, attention_class, self.norm_class)
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class MixtralForCausalLM(CausalLM):
    """Mixtral decoder + LM head. Expert tensors are stacked at load into each layer's FusedMoE.

    Checkpoint names: HF's `block_sparse_moe.gate` / `block_sparse_moe.experts.N.w1|w3|w2`, or
    transformers 5's `mlp.gate` / `mlp.experts.gate_up_proj|down_proj` (the layer's MLP is `mlp` here).
    Declares the LM head fusion and, for stacks of the standard blocks, DECODER_STACK with MoEWeights.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = (".self_attn.k_scale", ".self_attn.v_scale")
    required_ops: ClassVar[tuple[str, ...]] = ("fused_moe",)
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ("w8a16", "w4a16")  # experts too (layers/moe.py)
    # GPTQ / AWQ: attention and dense layers stay packed; experts are dequantized at load (layers/packed_experts.py)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("gptq", "awq", "fp8")
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.json",)
    renamed_modules: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}
    # each layer's attention block (gpt-oss's adds sinks)
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention
    # the decoder stack (PhiMoE's LayerNorm / LongRoPE one)
    stack_class: ClassVar[type[MoEModel]] = MoEModel

    def __init__(self, config: MoEModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.ops = ops
        qkv_bias, o_bias = self.attention_biases(config)

        def layer_mlp(cfg: MoEModelConfig, layer_idx: int) -> nn.Module:
            return self.make_mlp(cfg, layer_idx, ops, dtype, device, tp_rank, tp_size)

        self.model = self.stack_class(config, layer_mlp, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size,
                                      self.attention_class)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MoEModelConfig:
        """config.json -> MoEModelConfig, validated (see parse_mixtral_config)."""
        return parse_mixtral_config(raw, source)

    @classmethod
    def with_expert_parallel(cls, config: MoEModelConfig) -> MoEModelConfig:
        """--enable-expert-parallel: the routed experts are split whole over the ranks (E/tp each), while attention,
        the dense MLPs and a shared expert stay tensor parallel (models/layers/moe.py FusedMoE)."""
        return dataclasses.replace(config, expert_parallel=True)

    @staticmethod
    def attention_biases(config: MoEModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): (config.qkv_bias, False); Mixtral has neither."""
        return config.qkv_bias, False

    @staticmethod
    def make_mlp(config: MoEModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: Mixtral's sparse MoE block (top-k renormalized, no shared expert)."""
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, config.norm_topk_prob,
                              config.shared_expert_intermediate_size, ops, dtype, device, tp_rank, tp_size,
                              expert_parallel=config.expert_parallel)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states (T, hidden) of a flat batch; writes the tokens' K/V (see CausalLM.forward)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers; "
                             "allocate one (k_cache, v_cache) pair per layer (see kv_cache_shape())")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype."""
        return self.lm_head(hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim) of the paged KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def fusions(self) -> dict[str, Any]:
        """LM_HEAD while compute_logits is this class's plain head; DECODER_STACK while the forward is
        this class's and every layer the standard block (_fusable_block) with one rotary table and
        one attention geometry, its MLP a plain SparseMoeBlock (as MoEWeights) or GatedMLP."""
        found: dict[str, Any] = {}
        head = self.lm_head
        if type(self).compute_logits is MixtralForCausalLM.compute_logits and type(head) is LMHead:
            found[LM_HEAD] = LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size,
                                          tied=head.weight is self.model.embed_tokens.weight)
        stack = self.model
        first = stack.layers[0].self_attn if len(stack.layers) else None
        moes = [None if type(layer.mlp) is GatedMLP else self.decode_stack_moe(layer.mlp) for layer in stack.layers]
        if (type(self).forward is MixtralForCausalLM.forward and type(stack) is MoEModel and first is not None
                and type(stack.embed_tokens) is VocabEmbedding and type(stack.norm) is RMSNorm
                and all(_fusable_block(layer, first, stack.rotary_emb, moe)
                        for layer, moe in zip(stack.layers, moes, strict=True))):
            rotary = stack.rotary_emb
            dense = [layer.mlp for layer in stack.layers if type(layer.mlp) is GatedMLP]
            found[DECODER_STACK] = DecoderStackFusion(
                layers=tuple(_layer_weights(layer, moe) for layer, moe in zip(stack.layers, moes, strict=True)),
                num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                scale=first.attn.scale,
                intermediate_size=dense[0].gate_up_proj.output_sizes[0] if dense else self.config.intermediate_size,
                activation="silu", rotary=RotaryTable(rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox),
                embed_tokens=stack.embed_tokens.weight.data, embed_tp_size=stack.embed_tokens.tp_size,
                norm=RMSNormWeights.of(stack.norm), ops=self.ops)
        return found

    @staticmethod
    def decode_stack_moe(mlp: nn.Module) -> MoEWeights | None:
        """A layer's sparse MLP as the fused decode stack's MoEWeights; None when the stack cannot run it as is."""
        return sparse_moe_weights(mlp)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights, with each FusedMoE's stacked parameters counted loaded once every
        expert's projections (or the stacked tensor) arrived. GPTQ / AWQ experts arrive as the float weights
        their integers stand for (packed_experts.dequantized_experts)."""
        return with_fused_experts(self, super().load_weights(
            dequantized_experts(weights, self.config.quantization, self._holds_expert)))

    def _holds_expert(self, linear: str) -> bool:
        """Whether this rank holds the expert of a checkpoint projection (`<...>.experts.<e>.<proj>`), found as its
        weight would load (_param_target): under expert parallelism another rank's packed experts are never
        dequantized."""
        param, shard = self._param_target(f"{linear}.weight")
        if not isinstance(shard, tuple):
            return True
        experts = self.get_submodule(param.rpartition(".")[0])
        return not experts.expert_parallel or shard[0] in experts.local_experts()

    def _param_target(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter, shard): module renames, then expert tensors, then packed projections."""
        name = self.renamed(name)
        target = expert_param_target(name)
        return target if target is not None else super()._param_target(name)


def _fusable_block(layer: nn.Module, first: LlamaAttention, rotary: RotaryEmbedding, moe: MoEWeights | None) -> bool:
    """Whether `layer` computes what DecoderLayerWeights describes (this file's and the layers' classes, not
    subclasses), with `first`'s attention geometry and the shared `rotary` table: its MLP a GatedMLP or the
    sparse MLP `moe` describes."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return ((type(mlp) is GatedMLP or moe is not None) and type(layer) is MoEDecoderLayer
            and type(attn) is LlamaAttention and type(attn.attn) is Attention
            and attn.rotary_emb is rotary and type(rotary) is RotaryEmbedding
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and plain_head_norms(attn) and (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale)
            == (first.num_heads, first.num_kv_heads, first.head_dim, first.attn.scale))


def sparse_moe_weights(mlp: nn.Module) -> MoEWeights | None:
    """A SparseMoeBlock (this class, its router, experts and shared expert the layers' own) as MoEWeights; None
    for anything else."""
    if type(mlp) is not SparseMoeBlock:
        return None
    experts, shared, linear = mlp.experts, mlp.shared_expert, LinearWeights.of
    if type(mlp.gate) is not RouterLinear or type(experts) is not FusedMoE or (
            shared is not None and (type(shared) is not GatedMLP or type(mlp.shared_expert_gate) is not RouterLinear)):
        return None
    stacked = [None if t is None else t.data
               for t in (experts.w13_weight, experts.w2_weight, experts.w13_scale, experts.w2_scale)]
    blocks = None if experts.expert_blocks is None else tuple(
        (LinearWeights(w13, None, experts.tp_size), LinearWeights(w2, None, experts.tp_size))
        for w13, w2 in experts.expert_blocks)
    return MoEWeights(
        router=linear(mlp.gate), top_k=mlp.top_k, renormalize=mlp.renormalize, w13=stacked[0], w2=stacked[1],
        w13_scale=stacked[2], w2_scale=stacked[3], experts_tp_size=experts.tp_size,
        shared_gate_up=None if shared is None else linear(shared.gate_up_proj),
        shared_down=None if shared is None else linear(shared.down_proj),
        shared_gate=None if shared is None else linear(mlp.shared_expert_gate), expert_blocks=blocks)


def _layer_weights(layer: MoEDecoderLayer, moe: MoEWeights | None) -> DecoderLayerWeights:
    """One fusable block's weights (see _fusable_block) as the fusion record holds them."""
    attn, mlp, linear, norm = layer.self_attn, layer.mlp, LinearWeights.of, RMSNormWeights.of
    norms = (norm(layer.input_layernorm), norm(layer.post_attention_layernorm))
    if moe is None:
        return DecoderLayerWeights(*norms, linear(attn.qkv_proj), linear(attn.o_proj), linear(mlp.gate_up_proj),
                                   linear(mlp.down_proj), attn.attn.sliding_window, **head_norms(attn))
    return DecoderLayerWeights(*norms, linear(attn.qkv_proj), linear(attn.o_proj), None, None,
                               attn.attn.sliding_window, moe, **head_norms(attn))
