"""EAGLE-1 draft heads: one Llama decoder layer fed the target's final hidden state and the next token's embedding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.base import CausalLM
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.linear import ReplicatedLinear
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaDecoderLayer
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# checkpoint tensors of an EAGLE-1 head that load nowhere: its copy of the target's (frozen) embedding
_SHARED_WITH_TARGET = ("embed_tokens.weight",)


class EagleHead(CausalLM):
    """An EAGLE-1 head (Li et al., 2024) on its own small K/V cache.

    At position i it reads the target's final hidden state h_i (after the model's last norm: what the LM head
    reads) and the target's embedding of token t_{i+1}, and predicts the feature of position i + 1:
        x_i = fc(concat(emb(t_{i+1}), h_i))          # a (2H -> H) linear, with a bias where the checkpoint has one
        a_i = x_i + attn(x_i)                         # layer 0 has no input norm: x_i enters attention as is
        o_i = a_i + mlp(post_attention_layernorm(a_i))
        logits_i = lm_head(o_i)                       # the target's LM head, no norm in between
    o_i stands in for the target's h_{i+1} when the head drafts further. The checkpoint holds fc.* and
    layers.0.* (no input_layernorm); embedding and LM head are the target's. One rank only.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, *, target: Any = None, fc_bias: bool = True) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if tp_size != 1:
            raise ValueError("an EAGLE head runs on one rank; use --tensor-parallel-size 1 with "
                             "--speculate_method eagle")
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        head = getattr(target, "lm_head", None)
        if embed is None or head is None:
            raise ValueError(f"an EAGLE head needs the target's model.embed_tokens and lm_head; "
                             f"{type(target).__name__} has {'neither' if embed is head else 'only one'}")
        h = config.hidden_size
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling, ops, device)
        self.fc = ReplicatedLinear(2 * h, h, fc_bias, ops, dtype, device)
        layer = LlamaDecoderLayer(config, 0, self.rotary_emb, ops, dtype, device, config.attention_bias,
                                  config.attention_bias)
        layer.input_layernorm = None  # EAGLE-1's layer 0 feeds fc's output to attention unnormalized
        self.layers = nn.ModuleList([layer])
        # held in a tuple, so the target's modules stay out of this module's parameters (loaded once, by the target)
        self._io: tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] = (embed, head)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """The head's config.json: a Llama config (EAGLE-1 ships one with num_hidden_layers 1)."""
        return parse_llama_config(raw, source)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                attn_metadata: AttentionMetadata, previous_hidden: Tensor | None = None) -> Tensor:
        """input_ids (T,) the tokens t_{i+1}, positions (T,) the positions i, previous_hidden (T, hidden) h_i in
        the model dtype; kv_caches [(k_cache, v_cache)] (num_blocks, block_size, kv_heads, head_dim), written at
        slot_mapping -> o_i (T, hidden)."""
        if previous_hidden is None or previous_hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"the EAGLE head needs previous_hidden of shape ({input_ids.shape[0]}, "
                             f"{self.config.hidden_size}): the target's final hidden state per token")
        layer = self.layers[0]
        x = self.fc(torch.cat((self._io[0](input_ids), previous_hidden), dim=-1))
        attended = layer.self_attn(positions, x, kv_caches[0], attn_metadata)
        hidden, residual = layer.post_attention_layernorm(attended, x)
        return layer.mlp(hidden) + residual

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """o (N, hidden) -> logits (N, vocab_size) through the target's LM head, in the model dtype."""
        return self._io[1](hidden)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(1 layer, num_kv_heads, head_dim): the head's own K/V cache."""
        attn = self.layers[0].self_attn
        return 1, attn.num_kv_heads, attn.head_dim


def load_eagle_head(head_dir: str | Path, target: Any, target_hidden_size: int, target_vocab_size: int, ops: Any,
                    dtype: torch.dtype, device: torch.device, quant: Any = None) -> EagleHead:
    """The EAGLE-1 head in head_dir (config.json + safetensors) beside the loaded `target`.

    ModelLoadError (one line) when its config is not a one-layer Llama head of the target's hidden size and
    vocabulary, or its weights are not an EAGLE-1 head's."""
    import json

    from flashllm.lora.merge import checkpoint_headers
    from flashllm.models.loader import load_selected_weights, safetensors_files

    head_dir = Path(head_dir)
    source = str(head_dir / "config.json")
    try:
        raw = json.loads((head_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source}: cannot read the EAGLE head's config ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: expected a JSON object")
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **raw}  # EAGLE configs may omit them
    config = parse_llama_config(raw, source)
    if config.hidden_size != target_hidden_size:
        raise ModelLoadError(f"the EAGLE head {head_dir} has hidden_size {config.hidden_size}, the target "
                             f"{target_hidden_size}: use a head trained for this model")
    if config.vocab_size != target_vocab_size:
        raise ModelLoadError(f"the EAGLE head {head_dir} has vocab_size {config.vocab_size}, the target "
                             f"{target_vocab_size}: use a head trained for this model")
    if config.num_hidden_layers != 1:
        raise ModelLoadError(f"{source}: num_hidden_layers={config.num_hidden_layers}; an EAGLE-1 head has one "
                             "decoder layer (EAGLE-3 heads are not supported yet)")
    files = safetensors_files(head_dir)
    names = set(checkpoint_headers(files)[0])
    if "fc.weight" not in names:
        raise ModelLoadError(f"{head_dir}: no fc.weight tensor; an EAGLE-1 head holds fc.* and layers.0.*")
    head = EagleHead(config, ops, dtype, torch.device(device), target=target, fc_bias="fc.bias" in names)
    load_selected_weights(head, head_dir, lambda name: None if name in _SHARED_WITH_TARGET else name, quant)
    return head
