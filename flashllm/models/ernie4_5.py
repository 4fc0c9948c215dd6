"""ERNIE 4.5 (transformers' Ernie4_5ForCausalLM, Ernie4_5_MoeForCausalLM): Llama's decoder with RoPE over adjacent
feature pairs and (dense, where use_bias) biases on every projection; the MoE variant routes each token by softmax
scores plus a choice bias (moe_statics) to moe_k of moe_num_experts experts, renormalized, beside shared experts."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from flashllm.models.deepseek_moe import SharedExpertsMoEConfig, SharedExpertsMoEForCausalLM
from flashllm.models.hf_config import MAX_INTERMEDIATE_SIZE, MAX_NUM_LAYERS, ModelLoadError, flag, positive_int
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.mixtral import MAX_NUM_EXPERTS, check_prequantized_experts, moe_config

# transformers' Ernie4_5Config / Ernie4_5_MoeConfig defaults where they are not parse_llama_config's
_DEFAULTS = {"head_dim": 128, "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
_MOE_DEFAULTS = {"moe_num_experts": 64, "moe_k": 6, "moe_intermediate_size": 1536, "moe_num_shared_experts": 2,
                 "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1}
_STATICS = re.compile(r"^(model\.layers\.\d+\.mlp)\.(?:gate\.)?moe_statics\.e_score_correction_bias$")
_MTP = "model.mtp_"  # the checkpoints' next-token-prediction parts (mtp_block, mtp_linear_proj, ...), unused here


def parse_ernie4_5_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """Validate an Ernie4_5ForCausalLM config.json: Llama's fields with transformers' ERNIE 4.5 defaults (head_dim
    128, rope_theta 500000, tied embeddings), q / k / v / o and MLP biases where use_bias, adjacent-pair RoPE."""
    fields = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}  # rope_parameters' theta wins
    bias = flag(raw, "use_bias", source)
    fields.update(attention_bias=bias, mlp_bias=bias)
    return dataclasses.replace(parse_llama_config(fields, source), rope_interleaved=True, raw=raw)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5 dense (0.3B): Llama's checkpoint names; next-token-prediction tensors (`model.mtp_*`) skipped."""

    # sentencepiece, through tokenizer_config's Ernie4_5Tokenizer (built natively: models/tokenizers)
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.model",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig, validated (see parse_ernie4_5_config)."""
        return parse_ernie4_5_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """LlamaForCausalLM.load_weights over the checkpoint less its MTP tensors."""
        return super().load_weights((name, t) for name, t in weights if not name.startswith(_MTP))


@dataclass(frozen=True, slots=True)
class Ernie4_5MoeModelConfig(SharedExpertsMoEConfig):
    """An ERNIE 4.5 MoE config.json: softmax scores with the choice bias, renormalized, no groups; moe_norm_min
    the floor of the renormalizing sum."""

    moe_norm_min: float = 1e-12


def parse_ernie4_5_moe_config(raw: dict[str, Any], source: str = "config.json") -> Ernie4_5MoeModelConfig:
    """Validate an Ernie4_5_MoeForCausalLM config.json: the dense fields (parse_ernie4_5_config) and the MoE ones with
    transformers' defaults. Layer i is MoE when (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <=
    moe_layer_end_index (-1: the last layer). Raises ModelLoadError (one line naming the field)."""
    if flag(raw, "use_bias", source):
        raise ModelLoadError(f"{source}: use_bias=true is not supported for {raw['architectures'][0]} (its LM head "
                             "would carry a bias too); every published ERNIE 4.5 MoE checkpoint has use_bias false")
    fields = {**_MOE_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    for name, alias in (("moe_num_experts", "num_experts"), ("moe_k", "num_experts_per_tok")):
        if raw.get(name) is None and raw.get(alias) is not None:
            fields[name] = raw[alias]
    base = parse_ernie4_5_config(raw, source)
    layers = base.num_hidden_layers
    experts = positive_int(fields, "moe_num_experts", None, MAX_NUM_EXPERTS, source)
    top_k = positive_int(fields, "moe_k", None, MAX_NUM_EXPERTS, source)
    if top_k > experts:
        raise ModelLoadError(f"{source}: moe_k={top_k} exceeds moe_num_experts={experts}; a token cannot go to more "
                             "experts than the layer has")
    inter = positive_int(fields, "moe_intermediate_size", 1536, MAX_INTERMEDIATE_SIZE, source)
    shared = fields["moe_num_shared_experts"]
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ModelLoadError(f"{source}: moe_num_shared_experts={shared!r} must be a non-negative int")
    start, end = _layer_index(fields, "moe_layer_start_index", layers, source), fields["moe_layer_end_index"]
    end = layers - 1 if end == -1 else _layer_index(fields, "moe_layer_end_index", layers, source)
    interval = positive_int(fields, "moe_layer_interval", 1, MAX_NUM_LAYERS, source)
    norm_min = fields.get("moe_norm_min", 1e-12)
    if isinstance(norm_min, bool) or not isinstance(norm_min, (int, float)) or not 0 <= norm_min < 1:
        raise ModelLoadError(f"{source}: moe_norm_min={norm_min!r} must be a number in [0, 1)")
    config = moe_config(
        base, Ernie4_5MoeModelConfig, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
        shared_expert_intermediate_size=shared * inter, norm_topk_prob=True,
        sparse_layers=tuple((i + 1) % interval == 0 and start <= i <= end for i in range(layers)),
        qkv_bias=False, n_routed_experts=experts, n_shared_experts=shared, sigmoid_scoring=False,
        group_limited=False, choice_bias=True, moe_norm_min=float(norm_min))
    check_prequantized_experts(config, source)
    return config


def _layer_index(fields: dict[str, Any], key: str, layers: int, source: str) -> int:
    value = fields[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < max(layers, 1):
        raise ModelLoadError(f"{source}: {key}={value!r} must be a layer index in 0..{layers - 1}")
    return value


class Ernie4_5_MoeForCausalLM(SharedExpertsMoEForCausalLM):
    """ERNIE 4.5 MoE (21B-A3B, 300B-A47B): router `mlp.gate` with its choice bias
    `mlp.moe_statics.e_score_correction_bias` ((1, E) in the checkpoints), per-expert `mlp.experts.N.*` (or
    transformers 5's stacked tensors), `mlp.shared_experts.*`; dense `mlp.*` elsewhere; no biases (use_bias
    false). `model.mtp_*` tensors are skipped."""

    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.model",)  # as the dense model's


    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> Ernie4_5MoeModelConfig:
        """config.json -> Ernie4_5MoeModelConfig, validated (see parse_ernie4_5_moe_config)."""
        return parse_ernie4_5_moe_config(raw, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint less its MTP tensors, the (1, E) choice bias as the
        router's (E,) e_score_correction_bias."""
        return super().load_weights(_router_named(weights))


def _router_named(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors less `model.mtp_*`, its choice bias (moe_statics, or a GGUF file's exp_probs_b, as
    (1, E)) as the router's (E,) e_score_correction_bias."""
    for name, tensor in weights:
        if name.startswith(_MTP):
            continue
        statics = _STATICS.match(name)
        if statics:
            yield f"{statics[1]}.gate.e_score_correction_bias", tensor.reshape(-1)
        elif name.endswith(".mlp.gate.e_score_correction_bias"):
            yield name, tensor.reshape(-1)
        else:
            yield name, tensor
