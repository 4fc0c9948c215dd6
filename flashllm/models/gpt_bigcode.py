"""GPTBigCode (`GPTBigCodeForCausalLM`: StarCoder 1 / StarCoderBase, SantaCoder, WizardCoder, IBM Granite-20B/34B-Code),
as transformers' GPTBigCodeConfig / GPTBigCodeForCausalLM read and run it: GPT-2's pre-norm block, learned absolute
position embeddings `wpe` added to the token embeddings `wte` (no RoPE), LayerNorms with a bias
(`layer_norm_epsilon`), one fused, biased `attn.c_attn` projection and a biased `attn.c_proj`, the ungated MLP
`c_proj(act(c_fc(x)))` with biases (`activation_function`, `n_inner` features, 4 x n_embd by default), a final
LayerNorm `ln_f` and an LM head tied to `wte` (unless config.json says otherwise).

`multi_query` (the default) gives every query head the one key / value head, and c_attn's rows are [q (n_embd) | k
(head_dim) | v (head_dim)]; without it the attention is multi-head and c_attn's rows go head by head, each head's q,
k and v rows side by side. `scale_attn_weights` (default true) scales scores by head_dim ** -0.5, else by 1. The
softmax-in-fp32 switches are numerics transformers applies in half precision (flashllm's softmax runs in fp32);
dropouts are training-only. Cross-attention (`add_cross_attention`) is refused. The stack is not Llama's, so the
model takes the per-op path (the plain LM head's fused path stays offered)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.gpt_neox import split_fused_qkv
from flashllm.models.hf_config import flag
from flashllm.models.layers.embedding import PositionEmbedding
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2ForCausalLM, Starcoder2Model

# transformers' GPTBigCodeConfig defaults where config.json leaves a field out
GPT_BIGCODE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
    "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True, "multi_query": True,
}
# GPT-2's config names -> transformers' generic ones (GPTBigCodeConfig.attribute_map; config.json may use either)
GPT2_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "n_positions": "max_position_embeddings"}
# what the view handed to parse_llama_config must not inherit from config.json: sizes it derives, rope and windows
UNREAD_LLAMA_FIELDS = ("num_key_value_heads", "head_dim", "intermediate_size", "rope_scaling", "rope_parameters",
                       "rope_theta", "partial_rotary_factor", "sliding_window", "use_sliding_window", "layer_types",
                       "attention_bias", "mlp_bias", "rms_norm_eps", "hidden_act")
FUSED_C_ATTN = re.compile(r"(.*\.attn)\.c_attn\.(weight|bias)")  # each layer's fused q / k / v: (prefix, weight or bias)


def gpt2_style_fields(raw: dict[str, Any], defaults: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """config.json under GPT-2's names (or the generic names transformers' attribute_map takes for them), completed
    by `defaults`, -> the fields parse_llama_config reads: the sizes, `n_inner` (4 x n_embd where null) as the MLP's
    width, `activation_function` as hidden_act, `layer_norm_epsilon` as the norms' eps, biases everywhere, and no
    rope or window (config.json's are not read). A pre-quantized checkpoint is refused (quantize at load with
    --quant_type), as is `add_cross_attention`. Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: {family} loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    given = {key: value for key, value in raw.items() if value is not None}
    for name, alias in GPT2_NAMES.items():
        if name not in given and alias in given:
            given[name] = given[alias]
    fields = {**defaults, **given}
    if flag(fields, "add_cross_attention", source):
        raise ModelLoadError(f"{source}: add_cross_attention=true is an encoder-decoder's cross-attention; flashllm "
                             f"runs {family} as a decoder only (set it false)")
    view = {key: value for key, value in fields.items() if key not in UNREAD_LLAMA_FIELDS}
    hidden, inner = fields["n_embd"], fields["n_inner"]
    view |= {alias: fields[name] for name, alias in GPT2_NAMES.items()}
    view |= {"intermediate_size": 4 * hidden if inner is None and isinstance(hidden, int) else inner,
             "hidden_act": fields["activation_function"], "rms_norm_eps": fields["layer_norm_epsilon"],
             "attention_bias": True, "mlp_bias": True}
    flag(fields, "scale_attn_weights", source)
    return view


def parse_gpt_bigcode_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig (gpt2_style_fields), with one key / value head where `multi_query` (the
    default), else as many as query heads. `multi_query` and `scale_attn_weights` stay in `raw`, validated. Raises
    ModelLoadError (one line)."""
    view = gpt2_style_fields(raw, GPT_BIGCODE_DEFAULTS, "GPTBigCode", source)
    view["num_key_value_heads"] = 1 if flag(view, "multi_query", source) else view["num_attention_heads"]
    return parse_llama_config(view, source, activations=tuple(PLAIN_ACTIVATIONS))


class GPTBigCodeModel(Starcoder2Model):
    """Token and position embeddings, StarCoder 2's pre-norm LayerNorm layers without RoPE, the final LayerNorm,
    under flashllm's `model.` names (the checkpoint's `transformer.` ones are renamed as they load)."""

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        self.rotary_emb = NoPositionEmbedding()  # the layers' too: positions enter through embed_positions
        self.embed_positions = PositionEmbedding(config.max_position_embeddings, config.hidden_size, dtype, device)

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """StarCoder 2's block (biased LayerNorms, attention and MLP) over queries and keys that are not rotated,
        its scores scaled by score_scale."""
        layer = Starcoder2DecoderLayer(config, layer_idx, NoPositionEmbedding(), ops, dtype, device, tp_rank,
                                       tp_size)
        layer.self_attn.attn.scale = self.score_scale(config, layer_idx)
        return layer

    @staticmethod
    def score_scale(config: LlamaModelConfig, layer_idx: int) -> float:
        """Layer `layer_idx`'s attention score scale: head_dim ** -0.5, or 1 where `scale_attn_weights` is false."""
        return config.head_dim**-0.5 if config.raw.get("scale_attn_weights", True) else 1.0


class GPTBigCodeForCausalLM(Starcoder2ForCausalLM):
    """GPTBigCode (module docstring). Each layer's fused c_attn weight and bias are cut into q, k and v rows as they
    load (split_fused_qkv: key / value head by key / value head, the group's query rows first, which is both the
    multi-query [q | k | v] and the multi-head per-head layout) and fused again into Llama's qkv_proj, each
    tensor-parallel rank taking its query heads' rows and the one key / value head replicated; `transformer.wte` /
    `wpe` / `ln_f`, `ln_1` / `ln_2`, `attn.c_proj`, `mlp.c_fc` / `mlp.c_proj` load as the embeddings, the final
    norm, the layers' norms, o_proj and the plain MLP's up / down projections."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.wte.": "model.embed_tokens.", "transformer.wpe.": "model.embed_positions.",
        "transformer.ln_f.": "model.norm.", "transformer.h.": "model.layers.", ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.", ".attn.c_proj.": ".self_attn.o_proj.", ".attn.": ".self_attn.",
        ".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj.",
    }
    # the causal-mask buffers older GPT-2-style checkpoints keep (transformers rebuilds them too)
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("transformer.bias", ".attn.bias", ".attn.masked_bias")
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_gpt_bigcode_config)."""
        return parse_gpt_bigcode_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GPTBigCodeModel:
        """GPTBigCode's stack: position embeddings, no RoPE."""
        return GPTBigCodeModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with each fused c_attn tensor cut into q / k / v rows (split_fused_qkv)."""
        return super().load_weights(split_fused_qkv(weights, self.config, FUSED_C_ATTN))
