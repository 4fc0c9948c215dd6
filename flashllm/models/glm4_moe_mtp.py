"""GLM-4.5's multi-token prediction layer (model.layers.{num_hidden_layers} of GLM-4.5 / 4.5-Air / 4.6 checkpoints):
DeepSeek-V3's MTP parts (enorm, hnorm, eh_proj, shared_head) around a GLM-4.5 decoder block, on its own K/V cache."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from flashllm.models.deepseek_mtp import NextTokenPredictor, add_mtp_parts
from flashllm.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeModelConfig, parse_glm4_moe_config
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.mixtral import MoEDecoderLayer


class Glm4MoeMTPLayer(MoEDecoderLayer):
    """The MTP block: GLM-4.5's attention and the MLP layer `layer_idx` would have (MoE past first_k_dense_replace),
    with add_mtp_parts's modules; checkpoint names under model.layers.{num_hidden_layers}. are its names."""

    def __init__(self, config: Glm4MoeModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, own_embedding: bool, own_head: bool) -> None:
        # the config of a decoder one layer deeper: the block's window and dense / sparse MLP as layer layer_idx's
        grown = dataclasses.replace(config, num_hidden_layers=layer_idx + 1,
                                    sliding_windows=(*config.sliding_windows, None),
                                    sparse_layers=(*config.sparse_layers, layer_idx >= config.first_k_dense_replace))
        qkv_bias, o_bias = Glm4MoeForCausalLM.attention_biases(grown)
        mlp = Glm4MoeForCausalLM.make_mlp(grown, layer_idx, ops, dtype, device, 0, 1)
        super().__init__(grown, layer_idx, rotary_emb, mlp, ops, dtype, device, qkv_bias, o_bias)
        add_mtp_parts(self, config, ops, dtype, device, own_embedding, own_head)


class Glm4MoeMTP(NextTokenPredictor):
    """GLM-4.5's MTP layer (NextTokenPredictor): the target's RoPE (half of each head, neox) on a paged K/V cache of
    one layer."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = Glm4MoeForCausalLM.packed_modules_mapping

    def build_layer(self, config: Glm4MoeModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    own_embedding: bool, own_head: bool) -> tuple[RotaryEmbedding, nn.Module]:
        """The target's rotary table, a Glm4MoeMTPLayer at index num_hidden_layers."""
        rotary = RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling, ops, device)
        layer = Glm4MoeMTPLayer(config, config.num_hidden_layers, rotary, ops, dtype, device, own_embedding, own_head)
        return rotary, layer

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Glm4MoeModelConfig:
        """The target's config.json, as Glm4MoeForCausalLM parses it."""
        return parse_glm4_moe_config(raw, source)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(1 layer, num_key_value_heads, head_dim): the MTP block's own K and V caches."""
        attn = self.layer.self_attn
        return 1, attn.num_kv_heads, attn.head_dim
