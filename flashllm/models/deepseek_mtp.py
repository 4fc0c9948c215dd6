"""Multi-token prediction (MTP): a checkpoint's next-token-prediction layer as a small model (DeepSeek-V3's here;
GLM-4.5's in glm4_moe_mtp.py, the same parts around its own block)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.deepseek import DeepseekDecoderLayer, dequantize_block_fp8, with_fused_experts
from flashllm.models.deepseek_config import DeepseekModelConfig, parse_deepseek_config
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, VocabEmbedding, Vocabulary, target_vocabulary
from flashllm.models.layers.linear import ReplicatedLinear
from flashllm.models.layers.moe import expert_param_target
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.rotary import RotaryEmbedding

# the most next-token-prediction layers a config may declare (V3 and R1 ship one)
MAX_MTP_LAYERS = 8


def num_mtp_layers(config: Any) -> int:
    """config.json's num_nextn_predict_layers (0 when absent): how many MTP layers follow the decoder's.
    ModelLoadError for a value that is not an integer in 0..MAX_MTP_LAYERS."""
    value = config.raw.get("num_nextn_predict_layers", 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MTP_LAYERS:
        raise ModelLoadError(f"config.json: num_nextn_predict_layers={value!r}; expected an integer in "
                             f"0..{MAX_MTP_LAYERS}")
    return value


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


def reads_from_target(model_dir: str | Path, config: Any) -> tuple[bool, bool]:
    """Which of the target's (embedding, LM head) the checkpoint's first MTP layer reads: each where the layer
    has no copy of its own (config: the target's parsed config). Reads the safetensors headers only."""
    own_embedding, own_head = _own_tables(*_layer_names(model_dir, config))
    return not own_embedding, not own_head


def _layer_names(model_dir: str | Path, config: Any) -> tuple[str, set[str]]:
    """The first MTP layer's name prefix and the checkpoint's tensor names (from the safetensors headers)."""
    from flashllm.lora.merge import checkpoint_headers
    from flashllm.models.loader import safetensors_files

    return f"model.layers.{config.num_hidden_layers}.", set(checkpoint_headers(safetensors_files(model_dir))[0])


def _own_tables(prefix: str, names: set[str]) -> tuple[bool, bool]:
    """Whether the MTP layer under `prefix` has an embedding and an output head of its own."""
    return prefix + "embed_tokens.weight" in names, prefix + "shared_head.head.weight" in names


def load_mtp(model_dir: str | Path, target: Any, ops: Any, dtype: torch.dtype, device: torch.device,
             quant: Any = None, vocabulary: Vocabulary | None = None) -> NextTokenPredictor:
    """The first MTP layer of the checkpoint in model_dir, beside the loaded `target` (its config, and its
    embedding / LM head where the checkpoint has no copies: `vocabulary` where not the target's own, whole
    copies of a tensor-parallel target's), quantized like it with `quant`; its class is the target class's
    next_token_predictor().

    ModelLoadError (one line) when config.json declares no MTP layer or the weights lack it."""
    from flashllm.models.loader import load_selected_weights

    config, predictor = target.config, getattr(type(target), "next_token_predictor", None)
    if predictor is None or num_mtp_layers(config) < 1:
        raise ModelLoadError(f"{model_dir}: config.json declares no next-token-prediction layer "
                             "(num_nextn_predict_layers); --speculate_method mtp needs a DeepSeek-V3 or GLM-4.5 "
                             "checkpoint with its MTP weights, or use another method (ngram, draft_model)")
    prefix, names = _layer_names(model_dir, config)
    if prefix + "eh_proj.weight" not in names:
        raise ModelLoadError(f"{model_dir}: config.json declares num_nextn_predict_layers but the weights have no "
                             f"{prefix}eh_proj.weight (a checkpoint converted without its MTP layer?); "
                             "--speculate_method mtp needs them")
    own_embedding, own_head = _own_tables(prefix, names)
    mtp = predictor()(config, ops, dtype, torch.device(device), target=target, own_embedding=own_embedding,
                      own_head=own_head, vocabulary=vocabulary)
    load_selected_weights(mtp, model_dir, lambda name: "layer." + name[len(prefix):] if name.startswith(prefix)
                          else None, quant)
    return mtp
