"""GPT-NeoX (`GPTNeoXForCausalLM`: EleutherAI's Pythia 70m..12b and GPT-NeoX-20B, and fine-tunes such as Dolly v2
and RedPajama-INCITE), as transformers' GPTNeoXConfig / GPTNeoXForCausalLM read and run it: LayerNorms with a bias
(`layer_norm_eps`), one fused `attention.query_key_value` projection whose output rows go head by head, each head's
q, k and v rows side by side, with a bias, and an output projection `attention.dense` (both biases where
`attention_bias`, the default); RoPE (NEOX halves) over the first `rotary_pct` (default 0.25) of each head with base
`rotary_emb_base` (default 10000), both inside `rope_parameters` as transformers 5 writes them; the ungated MLP
`dense_4h_to_h(gelu(dense_h_to_4h(x)))` with biases; a final LayerNorm and an untied, unbiased LM head `embed_out`.

`use_parallel_residual` (the default) runs each layer as x + attn(ln1(x)) + mlp(ln2(x)), two norms of the same
input summed as transformers sums them, (mlp + attn) + x; without it, x = x + attn(ln1(x)); x = x + mlp(ln2(x)).
There is no grouped-query attention: every query head has its own key and value head. Dropouts are training-only.
The stack is not Llama's, so the model takes the per-op path (the plain LM head's fused path stays offered)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS, PlainMLP
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2ForCausalLM, Starcoder2Model

# transformers' GPTNeoXConfig defaults (GPT-NeoX-20B's shape) where config.json leaves a field out
GPT_NEOX_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
    "intermediate_size": 24576, "hidden_act": "gelu", "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
    "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": False, "use_parallel_residual": True,
    "attention_bias": True,
}
GPT_NEOX_ROTARY = 0.25  # GPTNeoXConfig's rotary_pct default
GPT_NEOX_THETA = 10000.0  # its rotary_emb_base default
# the legacy top-level rope fields transformers moves into rope_parameters
_ROPE_FIELDS = ("rope_scaling", "rope_parameters", "rotary_pct", "rotary_emb_base", "rope_theta",
                "partial_rotary_factor")
_FUSED_QKV = re.compile(r"(.*\.(?:self_)?attention)\.query_key_value\.(weight|bias)")  # BLOOM: self_attention


def parse_gpt_neox_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: `layer_norm_eps` as the norms' eps, `attention_bias` on query_key_value and
    dense, biases on the MLP always, RoPE read as GPTNeoXConfig reads it (rope_parameters, else the legacy
    rope_scaling, completed by rotary_emb_base and rotary_pct), as many key / value heads as query heads, an ungated
    activation (PLAIN_ACTIVATIONS), full attention; `use_parallel_residual` stays in `raw`, validated. A
    pre-quantized checkpoint is refused (quantize at load with --quant_type). Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: GPT-NeoX loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    fields = {**GPT_NEOX_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    flag(fields, "use_parallel_residual", source)
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    head_dim = fields.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and heads > 0 and head_dim * heads != hidden:
        raise ModelLoadError(f"{source}: head_dim={head_dim} x num_attention_heads={heads} is not hidden_size="
                             f"{hidden}; GPT-NeoX's attention splits hidden_size into its heads")
    rope = fields.get("rope_scaling") or fields.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: rope_parameters / rope_scaling must be an object or null, got {rope!r}")
    # GPTNeoXConfig.convert_rope_params_to_dict: the rope dict's own values win over the legacy top-level fields
    rope = {"rope_theta": fields.get("rotary_emb_base", GPT_NEOX_THETA),
            "partial_rotary_factor": fields.get("rotary_pct", GPT_NEOX_ROTARY), **rope}
    fields = {key: value for key, value in fields.items() if key not in _ROPE_FIELDS and key != "num_key_value_heads"}
    fields |= {"rope_parameters": rope, "rms_norm_eps": fields["layer_norm_eps"], "mlp_bias": True,
               "attention_bias": flag(fields, "attention_bias", source), "sliding_window": None}
    return parse_llama_config(fields, source, rotary_default=GPT_NEOX_ROTARY, activations=tuple(PLAIN_ACTIVATIONS))


class GPTNeoXParallelLayer(nn.Module):
    """`use_parallel_residual`: x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x)), two norms of the
    same x. Called as run_decoder_stack's layers, the stream split as (hidden, residual), x = hidden + residual (the
    input norm adds them); the layer returns (mlp + attn, x), so the next add gives transformers' (mlp + attn) + x.
    Falcon's parallel blocks are this one too: its attention `attention_class` (LlamaAttention's signature: Falcon's
    ALiBi one), its MLP biased where `mlp_bias`, and with `shared_norm` (Falcon-7B, Falcon2-11B) no
    post_attention_layernorm, input_layernorm feeding the MLP as well."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int,
                 attention_class: type[LlamaAttention] = LlamaAttention, shared_norm: bool = False) -> None:
        super().__init__()
        bias = config.attention_bias
        self.self_attn = attention_class(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias,
                                         tp_rank, tp_size)
        self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, ops,
                            dtype, device, tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = (None if shared_norm else
                                         LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device))

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """hidden (T, H), residual (T, H) or None before the first layer -> (mlp + attn, the stream x), each (T, H)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(positions, normed, kv_cache, attn_metadata)
        if self.post_attention_layernorm is not None:
            normed = self.post_attention_layernorm(residual)
        return self.mlp(normed) + attended, residual


class GPTNeoXModel(Starcoder2Model):
    """Embedding, GPT-NeoX layers (parallel or sequential, as config.json says) and the final LayerNorm, under
    flashllm's `model.` names (the checkpoint's `gpt_neox.` ones are renamed as they load)."""

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """A parallel layer where `use_parallel_residual`, else StarCoder 2's sequential LayerNorm block (the same
        modules: biased LayerNorms, attention biases where attention_bias, the biased ungated MLP)."""
        if config.raw.get("use_parallel_residual", True):
            return GPTNeoXParallelLayer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)
        return Starcoder2DecoderLayer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)


class GPTNeoXForCausalLM(Starcoder2ForCausalLM):
    """GPT-NeoX (module docstring). Each layer's fused query_key_value weight and bias are cut into q, k and v rows as
    they load (see split_fused_qkv) and fused again, q then k then v, into Llama's qkv_proj, each tensor-parallel rank
    taking its heads' rows; `gpt_neox.embed_in`, `attention.dense`, `mlp.dense_h_to_4h` / `dense_4h_to_h`,
    `gpt_neox.final_layer_norm` and `embed_out` load as the embedding, o_proj, the plain MLP's up / down projections,
    the final norm and the LM head."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "gpt_neox.embed_in.": "model.embed_tokens.", "gpt_neox.final_layer_norm.": "model.norm.",
        "gpt_neox.layers.": "model.layers.", ".attention.dense.": ".self_attn.o_proj.", ".attention.": ".self_attn.",
        ".mlp.dense_h_to_4h.": ".mlp.up_proj.", ".mlp.dense_4h_to_h.": ".mlp.down_proj.", "embed_out.": "lm_head.",
    }
    # older checkpoints keep the causal-mask buffers (transformers ignores them too) and the rope table
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq", ".attention.bias",
                                                          ".attention.masked_bias")
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    lm_head_weight_name: ClassVar[str] = "embed_out.weight"

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_gpt_neox_config)."""
        return parse_gpt_neox_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GPTNeoXModel:
        """GPT-NeoX's LayerNorm stack."""
        return GPTNeoXModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with each fused query_key_value tensor cut into q / k / v rows (split_fused_qkv)."""
        return super().load_weights(split_fused_qkv(weights, self.config))


def split_fused_qkv(weights: Iterable[tuple[str, Tensor]], config: LlamaModelConfig,
                    fused: re.Pattern[str] = _FUSED_QKV) -> Iterator[tuple[str, Tensor]]:
    """`<layer>.attention.query_key_value.{weight,bias}` (BLOOM's `<layer>.self_attention.`), whose rows are (heads,
    [q | k | v], head_dim) as transformers views them, -> `<layer>.attention.{q,k,v}_proj.{weight,bias}` of (heads x
    head_dim) rows each, in head order; every other tensor passes through. Raises ModelLoadError naming a fused
    tensor of another size. With fewer key / value heads than query heads (Falcon) the rows go group by group,
    (kv_heads, [the group's q heads | k | v], head_dim), of which the above is the one-query-head case."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = heads // kv_heads
    for name, tensor in weights:
        match = fused.fullmatch(name)  # (prefix, weight or bias); GPTBigCode's are `<layer>.attn.c_attn.*`
        if match is None:
            yield name, tensor
            continue
        rest = tuple(tensor.shape[1:])
        if tensor.shape[0] != (heads + 2 * kv_heads) * head_dim:
            raise ModelLoadError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; config.json's {heads} "
                                 f"query and {kv_heads} key / value heads of {head_dim} need "
                                 f"{(heads + 2 * kv_heads) * head_dim}")
        per_group = materialize(tensor).reshape(kv_heads, group + 2, head_dim, *rest)
        prefix, kind = match.groups()
        yield f"{prefix}.q_proj.{kind}", per_group[:, :group].reshape(heads * head_dim, *rest)
        yield f"{prefix}.k_proj.{kind}", per_group[:, group].reshape(kv_heads * head_dim, *rest)
        yield f"{prefix}.v_proj.{kind}", per_group[:, group + 1].reshape(kv_heads * head_dim, *rest)
