"""Falcon (`FalconForCausalLM`: tiiuae's Falcon-7B / 40B / 180B and their -instruct tunes, Falcon2-11B, Falcon-RW-1B /
7B), as transformers' FalconConfig / FalconForCausalLM read and run it. Falcon3 and Falcon-Mamba are other
architectures. Every layout is one fused `self_attention.query_key_value` projection whose rows go key / value head
by key / value head, each group [its query heads | k | v] x head_dim, and an output projection `dense`:

- `new_decoder_architecture` (40B, 180B, Falcon2-11B): `num_kv_heads` groups; the parallel block
  x + attn(ln_attn(x)) + mlp(ln_mlp(x)) with two LayerNorms (`num_ln_in_parallel_attn` 2, the default there), or one
  `input_layernorm` feeding both (`num_ln_in_parallel_attn` 1, Falcon2-11B);
- otherwise `multi_query` (7B: one key / value head, so the rows are [all q | k | v]) or one key / value head per
  query head (Falcon-RW), in the parallel block with one `input_layernorm` (`parallel_attn`, the default) or the
  sequential pre-norm block (Falcon-RW).

RoPE (NEOX halves) over whole heads with `rope_parameters` / `rope_theta`, or, where `alibi` (Falcon-RW), ALiBi
instead: transformers divides the whole score, bias included, by sqrt(head_dim), so each head's slope is the usual
ALiBi slope / sqrt(head_dim). LayerNorms (`layer_norm_epsilon`) always carry a bias; the projections and the ungated
MLP `dense_4h_to_h(act(dense_h_to_4h(x)))` (`ffn_hidden_size`, 4 x hidden by default; `activation` gelu) carry one
where `bias`; a final `ln_f` and an LM head without a bias, tied to the embedding unless `tie_word_embeddings` is
false. Dropouts are training-only. The stack is not Llama's, so the model takes the per-op path."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.baichuan import check_alibi_kernel
from flashllm.models.errors import ModelLoadError
from flashllm.models.gpt_neox import GPTNeoXParallelLayer, split_fused_qkv
from flashllm.models.hf_config import flag
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2ForCausalLM, Starcoder2Model
from flashllm.ops.alibi_slopes import alibi_slopes

# transformers' FalconConfig defaults (Falcon-7B's shape) where config.json leaves a field out
FALCON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
    "layer_norm_epsilon": 1e-5, "alibi": False, "new_decoder_architecture": False, "multi_query": True,
    "parallel_attn": True, "bias": False, "max_position_embeddings": 2048, "bos_token_id": 11, "eos_token_id": 11,
    "activation": "gelu", "tie_word_embeddings": True,
}
# Llama's names for what FalconConfig reads under its own (ffn_hidden_size, num_kv_heads, layer_norm_epsilon,
# activation, bias): transformers ignores them in a Falcon config.json, so they are dropped before Falcon's decide
_LLAMA_NAMES = ("intermediate_size", "num_key_value_heads", "rms_norm_eps", "hidden_act", "attention_bias",
                "mlp_bias", "sliding_window", "use_sliding_window", "layer_types", "max_window_layers")
_ROPE_FIELDS = ("rope_scaling", "rope_parameters", "rope_theta")


@dataclass(frozen=True, slots=True)
class FalconModelConfig(LlamaModelConfig):
    """LlamaModelConfig plus Falcon's block: `alibi` (ALiBi instead of RoPE), `parallel_attn` (attention and MLP
    read the same input) and `num_ln_in_parallel_attn` (1: one norm feeds both; 2: ln_attn and ln_mlp)."""

    alibi: bool = False
    parallel_attn: bool = True
    num_ln_in_parallel_attn: int = 1


def parse_falcon_config(raw: dict[str, Any], source: str = "config.json") -> FalconModelConfig:
    """config.json -> FalconModelConfig, read as FalconConfig reads it (see the module docstring); the key / value
    heads from the layout (num_kv_heads, 1 for multi_query, else the query heads). Refused with one ModelLoadError
    line: a pre-quantized checkpoint (quantize at load with --quant_type), the layouts transformers' Falcon cannot
    run either, a head_dim other than hidden_size / heads, partial RoPE, apply_residual_connection_post_layernorm."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: Falcon loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    values = {key: value for key, value in raw.items() if value is not None and key not in _LLAMA_NAMES}
    if "n_embed" in values:  # FalconConfig's legacy name for hidden_size, which wins
        values["hidden_size"] = values["n_embed"]
    values = {**FALCON_DEFAULTS, **values}
    alibi, new_arch, parallel, bias = (flag(values, key, source) for key in
                                       ("alibi", "new_decoder_architecture", "parallel_attn", "bias"))
    if flag(values, "apply_residual_connection_post_layernorm", source):
        raise ModelLoadError(f"{source}: apply_residual_connection_post_layernorm is true; transformers' Falcon "
                             "(and flashllm) add the layer input, not its norm, to the residual stream")
    norms = _parallel_norms(values, new_arch, parallel, source)
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    kv_heads = _kv_heads(values, new_arch, flag(values, "multi_query", source), source)
    whole = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
    if values.pop("head_dim", whole) != whole:
        raise ModelLoadError(f"{source}: head_dim={raw['head_dim']!r} is not hidden_size / num_attention_heads = "
                             f"{whole}; Falcon's attention splits hidden_size into its heads")
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    partial = values.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict)
                         else 1.0)
    if partial != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor={partial!r}; Falcon turns whole heads (expected 1.0)")
    if alibi:  # transformers builds no rotary embedding into an ALiBi model's scores, whatever the rope fields say
        values = {key: value for key, value in values.items() if key not in _ROPE_FIELDS}
    values |= {"num_key_value_heads": kv_heads, "intermediate_size": values.get("ffn_hidden_size", 4 * hidden),
               "rms_norm_eps": values["layer_norm_epsilon"], "hidden_act": values["activation"],
               "attention_bias": bias, "mlp_bias": bias, "partial_rotary_factor": 1.0}
    llama = parse_llama_config(values, source, activations=tuple(PLAIN_ACTIVATIONS))
    parsed = {f.name: getattr(llama, f.name) for f in fields(LlamaModelConfig)} | {"raw": raw}
    return FalconModelConfig(**parsed, alibi=alibi, parallel_attn=parallel or new_arch,
                             num_ln_in_parallel_attn=norms)


def _parallel_norms(values: dict[str, Any], new_arch: bool, parallel: bool, source: str) -> int:
    """num_ln_in_parallel_attn as FalconDecoderLayer uses it: 2 by default in the new decoder architecture, else 1;
    the combinations whose modules transformers builds but whose forward cannot run are refused."""
    norms = values.get("num_ln_in_parallel_attn", 2 if new_arch else 1)
    if norms not in (1, 2) or isinstance(norms, bool):
        raise ModelLoadError(f"{source}: num_ln_in_parallel_attn={norms!r} must be 1 or 2")
    if new_arch and not parallel:
        raise ModelLoadError(f"{source}: new_decoder_architecture with parallel_attn false; transformers' Falcon "
                             "cannot run it either (the new decoder architecture is always parallel)")
    if parallel and not new_arch and norms == 2:
        raise ModelLoadError(f"{source}: num_ln_in_parallel_attn=2 without new_decoder_architecture; transformers' "
                             "Falcon cannot run it either (two norms need new_decoder_architecture true)")
    return norms


def _kv_heads(values: dict[str, Any], new_arch: bool, multi_query: bool, source: str) -> Any:
    """The key / value heads: num_kv_heads (default: the query heads) in the new decoder architecture, one with
    multi_query, else one per query head (an other num_kv_heads there is refused: transformers cannot run it)."""
    heads = values["num_attention_heads"]
    kv_heads = values.get("num_kv_heads", heads)
    if new_arch:
        if isinstance(kv_heads, int) and isinstance(heads, int) and kv_heads > 0 and heads % kv_heads != 0:
            raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of num_kv_heads="
                                 f"{kv_heads}; each key / value head serves an equal group of query heads")
        return kv_heads
    if multi_query:
        return 1
    if kv_heads != heads:
        raise ModelLoadError(f"{source}: num_kv_heads={kv_heads!r} with multi_query and new_decoder_architecture "
                             f"false; that layout has one key / value head per query head ({heads})")
    return heads


class FalconAlibiAttention(LlamaAttention):
    """LlamaAttention with ALiBi in the paged attention (built with a NoPositionEmbedding: no rotation).
    transformers' Falcon scales (q.k + alibi) by 1 / sqrt(head_dim), hence slopes of alibi_slopes(heads) /
    sqrt(head_dim); rank r takes its query heads' slopes. (transformers also rounds the slopes and slope x absolute
    position to bfloat16, which a relative bias cannot reproduce; with up to 8 heads the slopes are powers of two,
    so below position 256 both roundings are exact.)"""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        first = tp_rank * self.num_heads
        slopes = alibi_slopes(config.num_attention_heads)[first : first + self.num_heads] * self.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, ops,
                              alibi_slopes=slopes.to(device))


class FalconModel(Starcoder2Model):
    """Embedding, Falcon layers of config.json's block and the final LayerNorm, under flashllm's `model.` names
    (the checkpoint's `transformer.` ones are renamed as they load); no rotation where config.alibi."""

    def __init__(self, config: FalconModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        if config.alibi:  # the layers were built with a NoPositionEmbedding (build_layer)
            self.rotary_emb = NoPositionEmbedding()

    def build_layer(self, config: FalconModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """Sequential (StarCoder 2's LayerNorm block) or parallel with one norm or two (GPT-NeoX's); each with ALiBi
        attention where config.alibi."""
        attention = FalconAlibiAttention if config.alibi else LlamaAttention
        rotary = NoPositionEmbedding() if config.alibi else self.rotary_emb
        if not config.parallel_attn:
            return Starcoder2DecoderLayer(config, layer_idx, rotary, ops, dtype, device, tp_rank, tp_size,
                                          attention_class=attention)
        return GPTNeoXParallelLayer(config, layer_idx, rotary, ops, dtype, device, tp_rank, tp_size,
                                    attention_class=attention, shared_norm=config.num_ln_in_parallel_attn == 1)


class FalconForCausalLM(Starcoder2ForCausalLM):
    """Falcon (module docstring). Each layer's fused query_key_value weight (and bias) is cut into q, k and v rows as
    it loads (gpt_neox.split_fused_qkv, group by key / value head) and fused again, q then k then v, into qkv_proj,
    each tensor-parallel rank taking its heads' rows; `ln_attn` / `ln_mlp` load as the two-norm block's
    input_layernorm / post_attention_layernorm, `dense`, `dense_h_to_4h` / `dense_4h_to_h` and `ln_f` as o_proj,
    the plain MLP's up / down projections and the final norm."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.word_embeddings.": "model.embed_tokens.", "transformer.ln_f.": "model.norm.",
        "transformer.h.": "model.layers.", ".self_attention.dense.": ".self_attn.o_proj.",
        ".self_attention.": ".self_attn.", ".mlp.dense_h_to_4h.": ".mlp.up_proj.",
        ".mlp.dense_4h_to_h.": ".mlp.down_proj.", ".ln_attn.": ".input_layernorm.",
        ".ln_mlp.": ".post_attention_layernorm.",
    }
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    attention_needs: ClassVar[tuple[str, ...]] = ("ALiBi (Falcon-RW)",)

    def __init__(self, config: FalconModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        if config.alibi:
            check_alibi_kernel(ops)
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> FalconModelConfig:
        """config.json -> FalconModelConfig (parse_falcon_config)."""
        return parse_falcon_config(raw, source)

    def build_stack(self, config: FalconModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> FalconModel:
        """Falcon's LayerNorm stack."""
        return FalconModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with each fused query_key_value tensor cut into q / k / v rows (split_fused_qkv)."""
        return super().load_weights(split_fused_qkv(weights, self.config))
