"""Multi-token prediction (MTP): a checkpoint's next-token-prediction layer as a small model (DeepSeek-V3's here;
GLM-4.5's in glm4_moe_mtp.py, the same parts around its own block)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.block_fp8 import dequantize_block_fp8
from flashllm.models.deepseek import DeepseekDecoderLayer
from flashllm.models.deepseek_config import DeepseekModelConfig, parse_deepseek_config
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, VocabEmbedding, Vocabulary, target_vocabulary
from flashllm.models.layers.linear import ReplicatedLinear
from flashllm.models.layers.moe import expert_param_target, with_fused_experts
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding


class SharedHead(nn.Module):
    """`shared_head`: the MTP layer's final RMSNorm and, where the checkpoint has one, its own output head."""

    def __init__(self, config: DeepseekModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        if own_head:
            self.head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device)


def add_mtp_parts(layer: nn.Module, config: Any, ops: Any, dtype: torch.dtype, device: torch.device,
                  own_embedding: bool, own_head: bool) -> None:
    """What turns a decoder block into an MTP module (DeepSeek-V3 report, section 2.2; GLM-4.5 ships the same):
    enorm, hnorm, eh_proj (hidden, 2 x hidden), shared_head and, where the checkpoint has one, embed_tokens."""
    h, eps = config.hidden_size, config.rms_norm_eps
    if own_embedding:
        layer.embed_tokens = VocabEmbedding(config.vocab_size, h, dtype, device)
    layer.enorm = RMSNorm(h, eps, ops, dtype, device)
    layer.hnorm = RMSNorm(h, eps, ops, dtype, device)
    layer.eh_proj = ReplicatedLinear(2 * h, h, False, ops, dtype, device)
    layer.shared_head = SharedHead(config, ops, dtype, device, own_head)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """One MTP module: a full decoder block (MLA, then the dense or MoE MLP that layer `layer_idx` would have) fed
    by eh_proj(concat(enorm(embedding), hnorm(previous hidden))), then shared_head (add_mtp_parts). Checkpoint
    names under model.layers.{num_hidden_layers}. are this module's names."""

    def __init__(self, config: DeepseekModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, own_embedding: bool, own_head: bool) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device)
        add_mtp_parts(self, config, ops, dtype, device, own_embedding, own_head)


class NextTokenPredictor(CausalLM):
    """The first MTP layer of a checkpoint (DeepSeek-V3, GLM-4.5), run on its own cache.

    At position i it reads the target's final hidden state h_i (after the model's last norm, what the
    LM head reads) and the embedding of token t_{i+1}, and predicts t_{i+2}:
        x_i = eh_proj(concat(enorm(emb(t_{i+1})), hnorm(h_i)))   # embedding first, as the weight is laid out
        o_i = block(x_i)                                          # causal over the MTP layer's own cache
        logits_i = head(shared_head.norm(o_i))
    o_i (before the norm) stands in for the target's h_{i+1} when the layer is reused to draft further.
    Without its own embed_tokens / shared_head.head in the checkpoint, the target's are used (`target`, or
    `vocabulary`: whole copies of a tensor-parallel target's). It runs whole on one rank (the layer is small
    next to the model). Subclasses build `rotary_emb` and `layer` (a decoder block with add_mtp_parts's modules).
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: Any, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, *, target: Any = None, own_embedding: bool = True,
                 own_head: bool = True, vocabulary: Vocabulary | None = None) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if tp_size != 1:
            raise ValueError("the MTP layer runs whole on one rank (the driver, beside its shard of the target)")
        if (not own_embedding or not own_head) and target is None and vocabulary is None:
            raise ValueError("an MTP layer without its own embedding or head needs the target model's")
        embed, head = target_vocabulary(target, vocabulary)
        self.rotary_emb, self.layer = self.build_layer(config, ops, dtype, device, own_embedding, own_head)
        # held in a tuple, so the target's modules stay out of this module's parameters (loaded and quantized
        # once, by the target)
        self._io: tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] = (
            self.layer.embed_tokens if own_embedding else embed, self.layer.shared_head.head if own_head else head)

    def build_layer(self, config: Any, ops: Any, dtype: torch.dtype, device: torch.device, own_embedding: bool,
                    own_head: bool) -> tuple[RotaryEmbedding, nn.Module]:
        """(the rotary table, the MTP block with add_mtp_parts's modules) for `config`."""
        raise NotImplementedError

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata, previous_hidden: Tensor | None = None) -> Tensor:
        """input_ids (T,) the tokens t_{i+1}, positions (T,) the positions i, previous_hidden (T, hidden) h_i in
        the model dtype; kv_caches: the block's one cache tuple (kv_cache_shape), written at slot_mapping ->
        o_i (T, hidden), the block's output before shared_head.norm."""
        if previous_hidden is None or previous_hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"the MTP layer needs previous_hidden of shape ({input_ids.shape[0]}, "
                             f"{self.config.hidden_size}): the target's final hidden state per token")
        layer = self.layer
        x = layer.eh_proj(torch.cat((layer.enorm(self._io[0](input_ids)), layer.hnorm(previous_hidden)), dim=-1))
        hidden, residual = layer(positions, x, None, kv_caches[0], attn_metadata)
        return hidden + residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """o (N, hidden) -> logits (N, vocab_size) in the model dtype."""
        return self._io[1](self.layer.shared_head.norm(hidden))

    def drafting_head(self) -> tuple[Callable[[Tensor], Tensor] | None, Any]:
        """(norm, head) with compute_logits(o) = head(norm(o)): shared_head's norm, then its own head or the
        target's."""
        return self.layer.shared_head.norm, self._io[1]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Tensors named `layer.<name>` (the checkpoint's model.layers.{num_hidden_layers}.<name>)."""
        return with_fused_experts(self, super().load_weights(weights))

    def _param_target(self, name: str) -> tuple[str, Any]:
        target = expert_param_target(name)
        return target if target is not None else super()._param_target(name)


class DeepseekMTP(NextTokenPredictor):
    """DeepSeek-V3's MTP layer: an MLA block on its own latent cache."""

    kv_caches_per_layer: ClassVar[int] = 1

    def build_layer(self, config: DeepseekModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    own_embedding: bool, own_head: bool) -> tuple[RotaryEmbedding, nn.Module]:
        """The rotary table of the MLA rope part, a DeepseekMTPLayer at index num_hidden_layers."""
        rope = config.qk_rope_head_dim
        rotary = RotaryEmbedding(rope, rope, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
                                 ops, device, is_neox=not config.rope_interleaved)
        return rotary, DeepseekMTPLayer(config, config.num_hidden_layers, rotary, ops, dtype, device, own_embedding,
                                        own_head)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> DeepseekModelConfig:
        """The target's config.json, as DeepseekV3ForCausalLM parses it."""
        return parse_deepseek_config(raw, source)

    def set_matrix_absorption(self, enabled: bool) -> None:
        """--mla_use_matrix_absorption, as the target's layers take it (models/deepseek.py)."""
        self.layer.self_attn.absorbed = bool(enabled)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(1 layer, 1, kv_lora_rank + qk_rope_head_dim): the MTP block's own latent cache."""
        return 1, 1, self.config.latent_dim

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """NextTokenPredictor.load_weights, block-FP8 dequantized like the target's."""
        if self.config.fp8_block is not None:
            weights = dequantize_block_fp8(weights, self.config.fp8_block)
        return super().load_weights(weights)
