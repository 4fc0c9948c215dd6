"""GPT-Neo (`GPTNeoForCausalLM`: EleutherAI/gpt-neo-125M / 1.3B / 2.7B and their fine-tunes), as transformers'
GPTNeoConfig / GPTNeoForCausalLM read and run it: GPTBigCode's pre-norm block (flashllm.models.gpt_bigcode: learned
absolute positions `wpe` added to the token embeddings `wte`, no RoPE, biased LayerNorms with `layer_norm_epsilon`, the
biased ungated MLP `c_proj(act(c_fc(x)))`, `intermediate_size` wide (4 x hidden_size where null), `gelu_new` by
default, a final `ln_f` and a head tied to `wte`) with multi-head attention through separate q / k / v projections
without biases and a biased `out_proj`, whose scores are NOT scaled by head_dim ** -0.5 (GPT-Neo's attention never
scales them). `attention_types` ([[["global", "local"], 12]] by default: pairs of layers, the first of each global)
expands to one kind per layer; a local layer attends to the last `window_size` (256) positions, itself included,
through flashllm's sliding-window attention. Sizes are read under GPTNeoConfig's names (`num_layers`, `num_heads`)
or the generic ones its attribute_map takes. Dropouts are training-only; the causal-mask buffers of older checkpoints
are skipped. The stack is not Llama's, so the model takes the per-op path (the plain LM head's fused path stays
offered)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.gpt_bigcode import GPTBigCodeModel, gpt2_style_fields
from flashllm.models.hf_config import positive_int
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2ForCausalLM

# transformers' GPTNeoConfig defaults where config.json leaves a field out (gpt-neo-1.3B's shape), under the GPT-2
# names gpt2_style_fields reads: n_embd is hidden_size, n_layer num_layers, n_head num_heads, n_inner intermediate_size
GPT_NEO_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 2048, "n_embd": 2048, "n_layer": 24, "n_head": 16, "n_inner": None,
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256,
    "tie_word_embeddings": True, "window_size": 256, "attention_types": [[["global", "local"], 12]],
}
_GPT_NEO_NAMES = {"num_layers": "n_layer", "num_heads": "n_head", "intermediate_size": "n_inner"}
_LAYER_TYPES = {"global": "full_attention", "local": "sliding_attention"}  # attention_types' kinds -> layer_types'
_MAX_WINDOW = 1 << 20


def parse_gpt_neo_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig (gpt2_style_fields over GPTNeoConfig's names), as many key / value heads as
    query heads, `attention_types` expanded into one window per layer (`window_size` on local layers, none on global
    ones); `attention_types` and `window_size` stay in `raw`, validated. Raises ModelLoadError (one line)."""
    given = {key: value for key, value in raw.items() if value is not None}
    given |= {gpt2: given[name] for name, gpt2 in _GPT_NEO_NAMES.items() if name in given}
    view = gpt2_style_fields(given, GPT_NEO_DEFAULTS, "GPT-Neo", source)
    window = positive_int(view, "window_size", None, _MAX_WINDOW, source)
    kinds = expand_attention_types(view["attention_types"], source)
    if len(kinds) != view["num_hidden_layers"]:
        raise ModelLoadError(f"{source}: attention_types expands to {len(kinds)} layers but num_layers is "
                             f"{view['num_hidden_layers']}; give one kind per layer")
    view |= {"num_key_value_heads": view["num_attention_heads"], "attention_bias": False, "sliding_window": window,
             "layer_types": [_LAYER_TYPES[kind] for kind in kinds]}
    return parse_llama_config(view, source, activations=tuple(PLAIN_ACTIVATIONS))


def expand_attention_types(attention_types: Any, source: str) -> list[str]:
    """GPTNeoConfig.expand_attention_types_params: [[kinds, n], ...] -> each `kinds` list repeated n times, in order
    ("global" or "local" each). Raises ModelLoadError on another layout or kind."""
    layout = f"{source}: attention_types={attention_types!r} must be a list of [[\"global\" | \"local\", ...], count]"
    if not isinstance(attention_types, list | tuple):
        raise ModelLoadError(layout)
    kinds: list[str] = []
    for item in attention_types:
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], list | tuple)
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0):
            raise ModelLoadError(layout)
        unknown = [kind for kind in item[0] if kind not in _LAYER_TYPES]
        if unknown:
            raise ModelLoadError(f"{source}: attention_types has the kind {unknown[0]!r}; GPT-Neo's layers are "
                                 "'global' or 'local'")
        kinds.extend(list(item[0]) * item[1])
    return kinds


class GPTNeoAttention(LlamaAttention):
    """LlamaAttention (its signature, so it is a block's `attention_class`) with GPT-Neo's biases, none on q / k / v
    and one on out_proj, whatever the block asks, and scores left unscaled."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, False, True, tp_rank, tp_size)
        self.attn.scale = 1.0


class GPTNeoModel(GPTBigCodeModel):
    """GPTBigCode's stack (token and position embeddings, pre-norm LayerNorm layers, ln_f) with GPT-Neo's attention,
    each layer's window from config.sliding_windows."""

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """StarCoder 2's block over GPTNeoAttention, unrotated."""
        return Starcoder2DecoderLayer(config, layer_idx, NoPositionEmbedding(), ops, dtype, device, tp_rank, tp_size,
                                      attention_class=GPTNeoAttention)


class GPTNeoForCausalLM(Starcoder2ForCausalLM):
    """GPT-Neo (module docstring): `transformer.wte` / `wpe` / `ln_f`, `ln_1` / `ln_2`, `attn.attention.{q,k,v}_proj`
    / `out_proj`, `mlp.c_fc` / `mlp.c_proj` load as the embeddings, the final norm, the layers' norms, qkv_proj (each
    tensor-parallel rank taking its heads' rows), o_proj and the plain MLP's up / down projections."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.wte.": "model.embed_tokens.", "transformer.wpe.": "model.embed_positions.",
        "transformer.ln_f.": "model.norm.", "transformer.h.": "model.layers.", ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.", ".attn.attention.out_proj.": ".self_attn.o_proj.",
        ".attn.attention.": ".self_attn.", ".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj.",
    }
    # the causal / local mask buffers older checkpoints keep (transformers rebuilds them)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = (".attn.attention.bias", ".attn.attention.masked_bias")
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)  # the local layers

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_gpt_neo_config)."""
        return parse_gpt_neo_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GPTNeoModel:
        """GPT-Neo's stack."""
        return GPTNeoModel(config, ops, dtype, device, tp_rank, tp_size)
