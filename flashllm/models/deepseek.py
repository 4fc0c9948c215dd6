"""DeepSeek-V2 / V3 decoder: multi-head latent attention over a paged latent cache, then dense or MoE MLPs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.deepseek_config import DeepseekModelConfig, parse_deepseek_config
from flashllm.models.deepseek_moe import DeepseekMoE, decode_stack_moe, without_mtp_layers
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import expert_param_target, with_fused_experts
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, run_decoder_stack
from flashllm.registry.fusions import (
    DECODER_STACK,
    LM_HEAD,
    DecoderLayerWeights,
    DecoderStackFusion,
    LinearWeights,
    LMHeadFusion,
    MLAWeights,
    RMSNormWeights,
    RotaryTable,
)


class LatentUpProjection(ColumnParallelLinear):
    """kv_b_proj (H * (Dn + Dv), kv_lora_rank), split by heads over the ranks. It is never a matmul of its
    own: latent_attention reads it per head, so it stays in the model dtype whatever --quant_type says, and a GGUF
    file's blocks of it are dequantized (float_in_checkpoints)."""

    float_in_checkpoints: ClassVar[bool] = True

    def process_weights_after_loading(self, quant: Any = None) -> None:
        """Keep the float weight (the latent op reads it); `quant` is ignored on purpose."""
        super().process_weights_after_loading(None)


class DeepseekAttention(nn.Module):
    """MLA: queries (through a q_lora_rank bottleneck or not), one compressed latent + rotated shared key per
    token written to the latent cache, attention through ops.latent_attention, then o_proj."""

    def __init__(self, config: DeepseekModelConfig, rotary_emb: RotaryEmbedding, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.nope, self.rope, self.rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
        qk = self.nope + self.rope
        if config.num_attention_heads % tp_size:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not divisible by tp_size={tp_size}")
        self.num_heads = config.num_attention_heads // tp_size
        heads = config.num_attention_heads
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, False, ops, dtype, device, tp_rank, tp_size)
        else:
            self.q_a_proj = ReplicatedLinear(h, config.q_lora_rank, bias, ops, dtype, device, tp_rank, tp_size)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, ops, dtype, device)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk, False, ops, dtype, device,
                                                 tp_rank, tp_size)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.rank + self.rope, bias, ops, dtype, device, tp_rank, tp_size)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps, ops, dtype, device)
        self.kv_b_proj = LatentUpProjection(self.rank, heads * (self.nope + config.v_head_dim), False, ops, dtype,
                                            device, tp_rank, tp_size)
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, h, bias, ops, dtype, device, tp_rank, tp_size)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.scale = config.softmax_scale
        self.absorbed = True  # --mla_use_matrix_absorption (set_matrix_absorption)
        self._latent_attention = ops.latent_attention

    def _queries(self, hidden: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden); writes the tokens' latents into kv_cache[0]."""
        tokens = hidden.shape[0]
        q = self._queries(hidden).view(tokens, self.num_heads, self.nope + self.rope)
        compressed = self.kv_a_proj_with_mqa(hidden)  # (T, L + R)
        latent = self.kv_a_layernorm(compressed[:, :self.rank].contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.nope:].contiguous(),
                                     compressed[:, self.rank:].contiguous().view(tokens, 1, self.rope))
        q = torch.cat((q[..., :self.nope], q_pe), dim=-1)
        cache = kv_cache[0]
        out = self._latent_attention(
            q, torch.cat((latent, k_pe.view(tokens, self.rope)), dim=-1), cache.view(*cache.shape[:2], -1),
            self.kv_b_proj.weight.view(self.num_heads, -1, self.rank), attn_metadata.slot_mapping,
            attn_metadata.block_tables, attn_metadata.cu_seqlens_q, attn_metadata.seq_lens, self.scale, self.absorbed,
        )
        return self.o_proj(out.reshape(tokens, -1))


class DeepseekDecoderLayer(PreNormBlock):
    """Pre-norm block: x + mla(norm(x)), then + mlp(norm(.)); dense before first_k_dense_replace, MoE after."""

    def __init__(self, config: DeepseekModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.self_attn = DeepseekAttention(config, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        if layer_idx < config.first_k_dense_replace:
            self.mlp: nn.Module = GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device,
                                           tp_rank, tp_size)
        else:
            self.mlp = DeepseekMoE(config, ops, dtype, device, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)



class DeepseekModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    layer_class: ClassVar[type[DeepseekDecoderLayer]] = DeepseekDecoderLayer  # a subclass's own (MiniCPM3's)

    def __init__(self, config: DeepseekModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = self.build_embedding(config, dtype, device, tp_rank, tp_size)
        rope = config.qk_rope_head_dim
        self.rotary_emb = RotaryEmbedding(rope, rope, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling, ops, device, is_neox=not config.rope_interleaved)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    @staticmethod
    def build_embedding(config: DeepseekModelConfig, dtype: torch.dtype, device: torch.device, tp_rank: int,
                        tp_size: int) -> VocabEmbedding:
        """The token embedding (a subclass's scaled one: MiniCPM3's)."""
        return VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 (and, through DeepseekV3ForCausalLM, V3) with HF checkpoint names.

    The paged cache holds ONE tensor per layer, (num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim):
    the normalized latent and the rotated shared key of each token (kv_caches_per_layer = 1). Block-FP8
    weights (e4m3 `weight` + `weight_scale_inv` per block) are dequantized at load; the checkpoint's
    next-token-prediction layers (model.layers.{num_hidden_layers}.., V3's MTP) are skipped here
    (models/mtp_loading.py loads them as a speculative proposer).
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"gate_up_proj": ["gate_proj", "up_proj"]}
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    kv_caches_per_layer: ClassVar[int] = 1
    required_ops: ClassVar[tuple[str, ...]] = ("latent_attention", "fused_moe")
    attention_needs: ClassVar[tuple[str, ...]] = ("latent KV cache (MLA)",)
    weight_only_quant: ClassVar[tuple[str, ...] | None] = ("w8a16", "w4a16")  # kv_b_proj and routers stay float
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("fp8",)  # block FP8, dequantized at load
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.json",)
    stack_class: ClassVar[type[DeepseekModel]] = DeepseekModel  # a subclass's own (MiniCPM3's)

    def __init__(self, config: DeepseekModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.ops = ops
        self.model = self.stack_class(config, ops, dtype, device, tp_rank, tp_size)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DeepseekModelConfig:
        """config.json -> DeepseekModelConfig, validated (see flashllm.models.deepseek_config)."""
        return parse_deepseek_config(raw, source)

    @classmethod
    def with_expert_parallel(cls, config: DeepseekModelConfig) -> DeepseekModelConfig:
        """--enable-expert-parallel: the routed experts are split whole over the ranks (E/tp each), while
        MLA, the dense MLPs and the shared experts stay tensor parallel (models/layers/moe.py FusedMoE)."""
        return dataclasses.replace(config, expert_parallel=True)

    def set_matrix_absorption(self, enabled: bool) -> None:
        """--mla_use_matrix_absorption: attend in the latent space (True, the default) or up-project keys and
        values per head (False). Both compute the same function; absorption reads L + R values per cached
        token instead of H * (Dn + Dv)."""
        for layer in self.model.layers:
            layer.self_attn.absorbed = bool(enabled)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """Hidden states (T, hidden) of a flat batch; kv_caches: one (latent_cache,) per layer, float."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers; allocate one "
                             "latent cache per layer (see kv_cache_shape())")
        if len(kv_caches[0]) != 1 or not kv_caches[0][0].is_floating_point() or kv_caches[0][0].itemsize == 1:
            raise ValueError("DeepSeek MLA keeps one float latent cache per layer (no int8/fp8 KV cache yet); "
                             "run with --kv-cache-dtype auto")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, vocab_size) in the model dtype."""
        return self.lm_head(hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(num_layers, 1, kv_lora_rank + qk_rope_head_dim): one latent row per token, every rank whole."""
        return len(self.model.layers), 1, self.config.latent_dim

    def fusions(self) -> dict[str, Any]:
        """LM_HEAD while compute_logits is this class's plain head; DECODER_STACK (latent attention layers,
        registry/fusions.py MLAWeights) while the forward is this class's, every layer the plain block
        (_fusable_block) in the absorbed form, and the experts whole on this rank."""
        found: dict[str, Any] = {}
        head, stack = self.lm_head, self.model
        if type(self).compute_logits is DeepseekV2ForCausalLM.compute_logits and type(head) is LMHead:
            found[LM_HEAD] = LMHeadFusion(head.weight.data, head.qweight, head.num_embeddings, head.tp_size,
                                          tied=head.weight is stack.embed_tokens.weight)
        if (type(self).forward is DeepseekV2ForCausalLM.forward and type(stack) is DeepseekModel and len(stack.layers)
                and type(stack.embed_tokens) is VocabEmbedding and type(stack.norm) is RMSNorm
                and all(_fusable_block(layer, stack.rotary_emb) for layer in stack.layers)):
            first, rotary = stack.layers[0].self_attn, stack.rotary_emb
            dense = [layer.mlp for layer in stack.layers if type(layer.mlp) is GatedMLP]
            found[DECODER_STACK] = DecoderStackFusion(
                layers=tuple(_layer_weights(layer, self.config) for layer in stack.layers),
                num_heads=first.num_heads, num_kv_heads=1, head_dim=first.rank + first.rope, scale=first.scale,
                intermediate_size=dense[0].gate_up_proj.output_sizes[0] if dense else self.config.intermediate_size,
                activation="silu", rotary=RotaryTable(rotary.cos_sin_cache, rotary.rotary_dim, rotary.is_neox),
                embed_tokens=stack.embed_tokens.weight.data, embed_tp_size=stack.embed_tokens.tp_size,
                norm=RMSNormWeights.of(stack.norm), ops=self.ops)
        return found

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights after skipping MTP layers (block-FP8 weights arrive dequantized: models/loader.py);
        each FusedMoE's stacked parameters count as loaded once every expert's projections arrived."""
        stream = without_mtp_layers(weights, self.config.num_hidden_layers)
        return with_fused_experts(self, super().load_weights(stream))

    def _param_target(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (parameter, shard): expert tensors first, then packed projections."""
        target = expert_param_target(name)
        return target if target is not None else super()._param_target(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's MLA with sigmoid routing, e_score_correction_bias and optional neox RoPE."""


def _fusable_block(layer: nn.Module, rotary: RotaryEmbedding) -> bool:
    """Whether `layer` computes what DecoderLayerWeights with MLAWeights describes (this file's and the
    layers' classes, not subclasses): absorbed MLA on the shared `rotary` table, a GatedMLP or a DeepseekMoE
    whose routed experts are whole on this rank."""
    attn, mlp = layer.self_attn, layer.mlp
    plain = decode_stack_moe(mlp) is not None if type(mlp) is DeepseekMoE else type(mlp) is GatedMLP
    return (plain and type(layer) is DeepseekDecoderLayer and type(attn) is DeepseekAttention and attn.absorbed
            and attn.rotary_emb is rotary and type(rotary) is RotaryEmbedding
            and type(attn.kv_b_proj) is LatentUpProjection and type(attn.kv_a_layernorm) is RMSNorm
            and type(getattr(attn, "q_a_layernorm", None)) in (RMSNorm, type(None))
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm)


def _layer_weights(layer: DeepseekDecoderLayer, config: DeepseekModelConfig) -> DecoderLayerWeights:
    """One fusable block's weights (see _fusable_block) as the fusion record holds them."""
    attn, mlp, linear, norm = layer.self_attn, layer.mlp, LinearWeights.of, RMSNormWeights.of
    bottleneck = not hasattr(attn, "q_proj")
    o_proj = linear(attn.o_proj)
    mla = MLAWeights(
        q_a_proj=linear(attn.q_a_proj) if bottleneck else None,
        q_a_layernorm=norm(attn.q_a_layernorm) if bottleneck else None,
        q_b_proj=linear(attn.q_b_proj if bottleneck else attn.q_proj), kv_a_proj=linear(attn.kv_a_proj_with_mqa),
        kv_a_layernorm=norm(attn.kv_a_layernorm), kv_b=attn.kv_b_proj.weight.data.view(attn.num_heads, -1, attn.rank),
        o_proj=o_proj, nope_dim=attn.nope, rope_dim=attn.rope, latent_dim=attn.rank, v_dim=config.v_head_dim)
    norms = (norm(layer.input_layernorm), norm(layer.post_attention_layernorm))
    if type(mlp) is GatedMLP:
        return DecoderLayerWeights(*norms, None, o_proj, linear(mlp.gate_up_proj), linear(mlp.down_proj), None,
                                   mla=mla)
    moe = decode_stack_moe(mlp)
    return DecoderLayerWeights(*norms, None, o_proj, None, None, None, moe, mla)
