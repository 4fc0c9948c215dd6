"""StarCoder 2 (`Starcoder2ForCausalLM`, bigcode/starcoder2-3b / 7b / 15b and their instruct tunes): Llama's
attention (GQA, RoPE, biases on every projection by default: `use_bias`) in a pre-norm block whose norms are
LayerNorms with a bias (`norm_epsilon`) and whose MLP is ungated, `c_proj(gelu_tanh(c_fc(x)))`, with biases too.
`sliding_window`, where config.json sets one, applies to every layer. Embeddings are tied unless config.json says
otherwise (transformers' Starcoder2Config default). The stack is not Llama's, so the model takes the per-op path."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS, PlainMLP
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaAttention, LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' Starcoder2Config defaults where config.json leaves a field out
STARCODER2_DEFAULTS: dict[str, Any] = {"norm_epsilon": 1e-5, "use_bias": True, "tie_word_embeddings": True,
                                       "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096}


def parse_starcoder2_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: `norm_epsilon` as the norms' eps, `use_bias` as both the attention's and the
    MLP's bias, an ungated activation (PLAIN_ACTIVATIONS). A pre-quantized checkpoint is refused (quantize at load
    with --quant_type). Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: StarCoder 2 loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    fields = {**STARCODER2_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    bias = fields["use_bias"]
    if not isinstance(bias, bool):
        raise ModelLoadError(f"{source}: use_bias={bias!r} must be true or false")
    fields |= {"rms_norm_eps": fields["norm_epsilon"], "attention_bias": bias, "mlp_bias": bias}
    return parse_llama_config(fields, source, activations=tuple(PLAIN_ACTIVATIONS))


class Starcoder2DecoderLayer(PreNormBlock):
    """x + attn(layernorm(x)), then + mlp(layernorm(.)); the residual add fused in the norms. `norm_class` builds
    the norms, (hidden, eps, ops, dtype, device) -> module (Nemotron's 1 + w LayerNorm); `attention_class` the
    attention, LlamaAttention's signature (Falcon's ALiBi one)."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int,
                 norm_class: type[nn.Module] = LayerNorm,
                 attention_class: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        bias = config.attention_bias
        self.self_attn = attention_class(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias,
                                         tp_rank, tp_size)
        self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, ops,
                            dtype, device, tp_rank, tp_size)
        self.input_layernorm = norm_class(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = norm_class(config.hidden_size, config.rms_norm_eps, ops, dtype, device)


class Starcoder2Model(nn.Module):
    """Embedding, StarCoder 2 layers and the final LayerNorm (HF's `model.` prefix); a subclass may set another
    `norm_class` for every norm or build its own layers (build_layer)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    norm_class: ClassVar[type[nn.Module]] = LayerNorm

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = LlamaModel.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(self.build_layer(config, i, ops, dtype, device, tp_rank, tp_size)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """Layer `layer_idx` (a subclass's own: StableLM's); it rotates by the shared `self.rotary_emb`."""
        return Starcoder2DecoderLayer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size,
                                      self.norm_class)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder 2 (module docstring): Llama's attention names (q / k / v fused at load), `mlp.c_fc` / `mlp.c_proj`
    loaded as the plain MLP's up / down projections, LayerNorm weights and biases."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    renamed_modules: ClassVar[dict[str, str]] = {".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj."}
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    required_ops: ClassVar[tuple[str, ...]] = ("layer_norm",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_starcoder2_config)."""
        return parse_starcoder2_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> Starcoder2Model:
        """StarCoder 2's LayerNorm stack."""
        return Starcoder2Model(config, ops, dtype, device, tp_rank, tp_size)
