"""MPT (`MptForCausalLM`, and `MPTForCausalLM` as MosaicML's mpt-7b / mpt-30b and their -instruct / -chat /
-storywriter checkpoints name it), as transformers' MptConfig / MptForCausalLM read and run it: pre-norm layers of
LayerNorms without a bias (`layer_norm_epsilon`), one fused `attn.Wqkv` projection whose rows are all of q, then all
of k, then all of v, an output projection `attn.out_proj`, the ungated MLP `ffn.down_proj(gelu(ffn.up_proj(x)))`
(exact GELU, `expansion_ratio` x d_model wide), a final LayerNorm `norm_f` and an LM head tied to `wte`; no biases
anywhere. Every head adds ALiBi biases with the slopes of flashllm.ops.alibi_slopes: MPT's own rule (the 2^ceil(log2
n) geometric slopes, odd ones first) gives the same slopes as BLOOM's for every head count at alibi_bias_max 8, and
transformers adds slope x (key - last key) position, which differs from paged_attention's slope x (key - query) by a
constant per score row, which softmax ignores. `attn_config.softmax_scale` (default head_dim ** -0.5) scales the
scores and `clip_qkv` clamps q, k and v. Dropouts are training-only.

What transformers ignores but MosaicML's own code would compute differently is refused rather than guessed:
`alibi_bias_max` other than 8, `logit_scale`, `qk_ln`, `prefix_lm`, multi-query attention, learned positions
(`alibi` false), biases (`no_bias` false) and a gated `ffn_config`. config.json names its sizes either way (`d_model`
/ `hidden_size`, `n_heads` / `num_attention_heads`, `n_layers` / `num_hidden_layers`), read with transformers'
precedence; `max_seq_len` is the context."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.baichuan import BaichuanAlibiAttention
from flashllm.models.bloom import BloomForCausalLM, BloomModel, transformer_prefixed
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag, positive_float
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mlp import PlainMLP
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.layers.prequantized import split_output_features
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' MptConfig / MptAttentionConfig defaults where config.json leaves a field out
MPT_DEFAULTS: dict[str, Any] = {
    "d_model": 2048, "n_heads": 16, "n_layers": 24, "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50368,
    "layer_norm_epsilon": 1e-5, "no_bias": True, "logit_scale": None, "tie_word_embeddings": True,
    "bos_token_id": None, "eos_token_id": None,
}
MPT_ATTN_DEFAULTS: dict[str, Any] = {
    "attn_type": "multihead_attention", "clip_qkv": None, "softmax_scale": None, "prefix_lm": False, "qk_ln": False,
    "alibi": True, "alibi_bias_max": 8,
}
MPT_ACTIVATION = "gelu"  # nn.GELU(approximate="none")
_CHECKPOINT_FIELDS = ("architectures", "model_type", "vocab_size", "bos_token_id", "eos_token_id",
                      "tie_word_embeddings", "dtype", "torch_dtype")
_WQKV = re.compile(r"(.*)\.attn\.Wqkv\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class MptModelConfig(LlamaModelConfig):
    """LlamaModelConfig of an MPT config.json (rms_norm_eps holds layer_norm_epsilon, max_position_embeddings
    max_seq_len), plus attn_config's softmax_scale (None: head_dim ** -0.5) and clip_qkv (None: no clamp); every
    layer adds ALiBi biases."""

    softmax_scale: float | None = None
    clip_qkv: float | None = None

    @property
    def alibi(self) -> bool:
        """The attention adds ALiBi biases (read by the engine to resolve attention kernels that implement them)."""
        return True


def parse_mpt_config(raw: dict[str, Any], source: str = "config.json") -> MptModelConfig:
    """config.json -> MptModelConfig, sizes under either name (transformers' names win); what transformers and
    MosaicML's code would run differently is refused (module docstring). Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: MPT loads float checkpoints only (quantize them at load with --quant_type); "
                             "drop quantization_config or use a float checkpoint")
    given = {**MPT_DEFAULTS, **raw}
    attn = _attn_config(given.get("attn_config"), source)
    _refuse_unsupported(given, attn, source)
    hidden = given.get("hidden_size", given["d_model"])
    ratio = given["expansion_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio <= 0:
        raise ModelLoadError(f"{source}: expansion_ratio={ratio!r} must be a positive int (the MLP is "
                             "expansion_ratio x d_model wide)")
    view = {key: given[key] for key in _CHECKPOINT_FIELDS if key in given}
    view |= {"hidden_size": hidden, "intermediate_size": ratio * hidden if isinstance(hidden, int) else hidden,
             "num_hidden_layers": given.get("num_hidden_layers", given["n_layers"]),
             "num_attention_heads": given.get("num_attention_heads", given["n_heads"]),
             "max_position_embeddings": given["max_seq_len"], "rms_norm_eps": given["layer_norm_epsilon"],
             "hidden_act": MPT_ACTIVATION}
    llama = parse_llama_config(view, source, activations=(MPT_ACTIVATION,))
    values = {f.name: getattr(llama, f.name) for f in fields(LlamaModelConfig)}
    # transformers clamps where clip_qkv is truthy: 0 and null both mean no clamp
    clip = positive_float(attn, "clip_qkv", None, source) if attn["clip_qkv"] else None
    return MptModelConfig(**values | {"raw": raw}, softmax_scale=positive_float(attn, "softmax_scale", None, source),
                          clip_qkv=clip)


def _attn_config(value: Any, source: str) -> dict[str, Any]:
    """attn_config completed with MptAttentionConfig's defaults (absent or null: all defaults)."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ModelLoadError(f"{source}: attn_config must be an object or null, got {value!r}")
    return {**MPT_ATTN_DEFAULTS, **value}


def _refuse_unsupported(given: dict[str, Any], attn: dict[str, Any], source: str) -> None:
    """One ModelLoadError line for an MPT feature that transformers ignores or that flashllm does not run."""
    if not flag(attn, "alibi", source):
        raise ModelLoadError(f"{source}: attn_config.alibi=false (learned positions) is not supported; transformers' "
                             "MPT always adds ALiBi biases, expected true")
    for key in ("prefix_lm", "qk_ln"):
        if flag(attn, key, source):
            raise ModelLoadError(f"{source}: attn_config.{key}=true is not supported (transformers' MPT does not "
                                 "implement it either); expected false")
    if attn["attn_type"] != "multihead_attention":
        raise ModelLoadError(f"{source}: attn_config.attn_type={attn['attn_type']!r} is not supported; expected "
                             "'multihead_attention' (transformers' MPT runs nothing else)")
    if attn["alibi_bias_max"] != 8:
        raise ModelLoadError(f"{source}: attn_config.alibi_bias_max={attn['alibi_bias_max']!r} is not supported: "
                             "transformers' MPT always uses 8 and MosaicML's code the value given; expected 8")
    if given["logit_scale"] is not None:
        raise ModelLoadError(f"{source}: logit_scale={given['logit_scale']!r} is not supported (transformers' MPT "
                             "ignores it, MosaicML's code scales the logits); expected null")
    if not flag(given, "no_bias", source):
        raise ModelLoadError(f"{source}: no_bias=false (biased projections and norms) is not supported; transformers' "
                             "MPT has no biases, expected true")
    ffn = given.get("ffn_config") or {}
    if not isinstance(ffn, dict) or ffn.get("ffn_type", "mptmlp") != "mptmlp":
        raise ModelLoadError(f"{source}: ffn_config={ffn!r} is not supported; expected the plain MLP "
                             '({"ffn_type": "mptmlp"} or none)')


class MptBlock(PreNormBlock):
    """x + attn(norm_1(x)), then + ffn(norm_2(.)); the residual add fused in the norms (held under Llama's names)."""

    def __init__(self, config: MptModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = BaichuanAlibiAttention(config, ops, dtype, device, tp_rank, tp_size,
                                                scale=config.softmax_scale, clip_qkv=config.clip_qkv)
        self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, False, config.hidden_act, ops, dtype, device,
                            tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device, bias=False)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device,
                                                  bias=False)


class MptModel(BloomModel):
    """`wte` (no norm after it), MPT blocks and `norm_f` (no bias), under flashllm's `model.` names."""

    block_class: ClassVar[type[nn.Module]] = MptBlock
    norm_bias: ClassVar[bool] = False

    @staticmethod
    def build_embedding(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                        tp_size: int) -> VocabEmbedding:
        """The plain token embedding."""
        return VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)


class MptForCausalLM(BloomForCausalLM):
    """MPT (module docstring): BLOOM's model class over MPT's stack and names. Each layer's Wqkv is cut into its q, k
    and v thirds as it loads and fused again into qkv_proj, each tensor-parallel rank taking its heads' rows (and its
    heads' ALiBi slopes)."""

    stack_class: ClassVar[type[BloomModel]] = MptModel
    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.wte.": "model.embed_tokens.", "transformer.blocks.": "model.layers.",
        "transformer.norm_f.": "model.norm.", ".norm_1.": ".input_layernorm.", ".norm_2.": ".post_attention_layernorm.",
        ".attn.out_proj.": ".self_attn.o_proj.", ".attn.": ".self_attn.", ".ffn.": ".mlp.",
    }

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> MptModelConfig:
        """config.json -> MptModelConfig (parse_mpt_config)."""
        return parse_mpt_config(raw, source)

    def split_fused(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """`transformer.`-prefixed names, each Wqkv cut into its q / k / v thirds (split_wqkv)."""
        return split_wqkv(transformer_prefixed(weights), self.config.num_attention_heads * self.config.head_dim)


def split_wqkv(weights: Iterable[tuple[str, Tensor]], size: int,
               kv_size: int | None = None) -> Iterator[tuple[str, Tensor]]:
    """`<block>.attn.Wqkv.weight` (rows: all q, then all k, then all v, `size` each; k and v `kv_size` each where
    given: DBRX's grouped keys) -> `<block>.attn.{q,k,v}_proj.weight` (unread views); every other tensor passes
    through. Raises ModelLoadError naming a Wqkv of another size."""
    sizes = (size, size, size) if kv_size is None else (size, kv_size, kv_size)
    for name, tensor in weights:
        match = _WQKV.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        for part, rows in zip(("q_proj", "k_proj", "v_proj"), split_output_features(name, tensor, sizes, None),
                              strict=True):
            yield f"{prefix}.attn.{part}.{kind}", rows
