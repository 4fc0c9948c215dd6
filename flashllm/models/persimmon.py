"""Persimmon (`PersimmonForCausalLM`: adept/persimmon-8b-base / -chat, and Fuyu's language model), as transformers'
PersimmonConfig / PersimmonForCausalLM read and run it: pre-norm blocks of biased LayerNorms (`layer_norm_eps`), one
biased fused `self_attn.query_key_value` whose rows go head by head ([q | k | v] per head, GPT-NeoX's layout) and a
biased output projection `self_attn.dense`; with `qk_layernorm` (the default) every query and key head LayerNormed
over head_dim by one shared, biased LayerNorm each before RoPE; RoPE (NEOX halves) over the first
`partial_rotary_factor` (default 0.5) of each head; the ungated biased MLP `dense_4h_to_h(relu(dense_h_to_4h(x))^2)`
(`hidden_act` relu2); a final LayerNorm and an untied, unbiased LM head. No grouped-query attention. The stack is not
Llama's, so the model takes the per-op path."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.gpt_neox import split_fused_qkv
from flashllm.models.hf_config import flag
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2ForCausalLM, Starcoder2Model

# transformers' PersimmonConfig defaults (persimmon-8b's shape) where config.json leaves a field out
PERSIMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 36,
    "num_attention_heads": 64, "hidden_act": "relu2", "max_position_embeddings": 16384, "layer_norm_eps": 1e-5,
    "tie_word_embeddings": False, "qk_layernorm": True, "bos_token_id": 1, "eos_token_id": 2,
}
PERSIMMON_ROTARY = 0.5  # PersimmonConfig's partial_rotary_factor default
_FUSED_QKV = re.compile(r"(.*\.self_attn)\.query_key_value\.(weight|bias)")


def parse_persimmon_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig over PERSIMMON_DEFAULTS: `layer_norm_eps` as the norms' eps, biases on every
    projection, head_dim = hidden_size / num_attention_heads and as many key / value heads as query heads (whatever
    config.json says of either, as transformers derives them), RoPE over `partial_rotary_factor` (top level or in
    rope_parameters), an ungated activation (PLAIN_ACTIVATIONS), full attention; `qk_layernorm` stays in `raw`,
    validated. A pre-quantized checkpoint is refused (quantize at load with --quant_type). Raises ModelLoadError
    (one line)."""
    refuse_prequantized(raw, source)
    fields = {**PERSIMMON_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    flag(fields, "qk_layernorm", source)
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads:
        raise ModelLoadError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                             "Persimmon's attention splits hidden_size into its heads")
    fields = {key: value for key, value in fields.items() if key not in ("num_key_value_heads", "head_dim")}
    fields |= {"rms_norm_eps": fields["layer_norm_eps"], "attention_bias": True, "mlp_bias": True,
               "sliding_window": None}
    return parse_llama_config(fields, source, rotary_default=PERSIMMON_ROTARY, activations=tuple(PLAIN_ACTIVATIONS))


class PersimmonAttention(LlamaAttention):
    """LlamaAttention (biased q / k / v and o) whose q / k norms, where `qk_layernorm`, are one biased LayerNorm over
    head_dim each, shared by every head (LlamaAttention applies them per head before RoPE)."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        if config.raw.get("qk_layernorm", True):
            self.q_norm = LayerNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)
            self.k_norm = LayerNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)


class PersimmonModel(Starcoder2Model):
    """Embedding, StarCoder 2's sequential LayerNorm blocks (biased norms, biased ungated MLP) with Persimmon's
    attention, and the final LayerNorm."""

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """StarCoder 2's block with PersimmonAttention."""
        return Starcoder2DecoderLayer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size,
                                      attention_class=PersimmonAttention)


class PersimmonForCausalLM(Starcoder2ForCausalLM):
    """Persimmon (module docstring). Each layer's fused query_key_value weight and bias are cut into q, k and v rows as
    they load (gpt_neox.split_fused_qkv) and fused again into qkv_proj, each tensor-parallel rank taking its heads'
    rows; `self_attn.dense`, `q_layernorm` / `k_layernorm`, `mlp.dense_h_to_4h` / `dense_4h_to_h` and
    `final_layernorm` load as o_proj, the q / k norms, the plain MLP's up / down projections and the final norm."""

    renamed_modules: ClassVar[dict[str, str]] = {
        ".self_attn.dense.": ".self_attn.o_proj.", ".self_attn.q_layernorm.": ".self_attn.q_norm.",
        ".self_attn.k_layernorm.": ".self_attn.k_norm.", ".mlp.dense_h_to_4h.": ".mlp.up_proj.",
        ".mlp.dense_4h_to_h.": ".mlp.down_proj.", "model.final_layernorm.": "model.norm.",
    }

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_persimmon_config)."""
        return parse_persimmon_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> PersimmonModel:
        """Persimmon's LayerNorm stack."""
        return PersimmonModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with each fused query_key_value tensor cut into q / k / v rows (split_fused_qkv)."""
        return super().load_weights(split_fused_qkv(weights, self.config, _FUSED_QKV))
