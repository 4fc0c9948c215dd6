"""Vision-language checkpoints served text-only: Gemma 3 (`Gemma3ForConditionalGeneration`: gemma-3-4b / 12b / 27b)
and Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2, Magistral Small, Devstral Small, and
Ministral 3, whose language model is models/ministral3.py's), and Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE).

Their language model is a family flashllm runs (Gemma 3, Mistral); config.json nests its fields under `text_config`
(only those that differ from the text config class's defaults, on the Hub) and the checkpoint names its tensors
under `language_model.` (the Hub's layout) or `model.language_model.` (transformers 5's). These classes read the
text config over those defaults, load the language model's tensors under flashllm's names and skip the vision tower
and the projector, whose tensors are never read. Prompts are text: an image in a request is refused where the chat
template meets it, as for any text model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.errors import ModelLoadError
from flashllm.models.gemma3 import Gemma3ForCausalLM
from flashllm.models.hf_config import HFModelConfig
from flashllm.models.llama import LlamaModel
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.ministral3 import Ministral3ForCausalLM, Ministral3Model
from flashllm.models.mistral import MistralForCausalLM
from flashllm.models.qwen2 import Qwen2ForCausalLM
from flashllm.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

# checkpoint prefixes of the parts a text-only model never runs (every layout)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                   "visual.", "model.visual.", "vision_model.", "model.vision_model.", "image_newline",
                   "model.image_newline", "model.connector.")  # LLaVA-NeXT's row separator, Idefics3's connector
# the language model's prefixes in either layout -> flashllm's
LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))  # last: Idefics3
# top-level config.json fields that describe the checkpoint rather than one tower: the text model inherits them.
# tie_word_embeddings too where the top level states it (transformers 5 ties the head by the top level's and saves no
# lm_head then); where it does not (the Hub's older files), the text config's says, as the saved tensors agree
INHERITED_FIELDS = ("torch_dtype", "dtype", "quantization_config")


def text_config(raw: dict[str, Any], defaults: dict[str, dict[str, Any]], source: str, flat_type: str | None = None,
                tie_either: bool = False) -> dict[str, Any]:
    """The language model's config.json dict: `text_config` over `defaults[its model_type]` (its config class's, where
    the text family's parser would read another default or none), the checkpoint-wide fields and `architectures`.

    flat_type: the language model's model_type where config.json may list its fields at the top level instead (the
    Hub's Qwen2-VL / Qwen2.5-VL files). tie_either: the head is tied where either level says so (transformers'
    Qwen-VL rule); otherwise the top level's value wins where stated. Multimodal RoPE ("mrope") is plain RoPE on
    text: every section turns by the same position. Raises ModelLoadError (one line) when there is no text_config or
    it is of a model_type not in `defaults` (whose first key is the default model_type)."""
    text = raw.get("text_config")
    if text is None and flat_type is not None:
        text = {key: value for key, value in raw.items() if key not in ("vision_config", "architectures", "model_type")}
        text["model_type"] = flat_type
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: {raw['architectures'][0]} has no text_config object; the checkpoint's "
                             "config.json is incomplete")
    model_type = text.get("model_type", next(iter(defaults)))
    if model_type not in defaults:
        raise ModelLoadError(f"{source}: text_config.model_type={model_type!r}; flashllm serves "
                             f"{raw['architectures'][0]} text-only with a {' / '.join(defaults)} language model")
    inherited = {key: raw[key] for key in INHERITED_FIELDS if key in raw and key not in text}
    given = {key: _without_mrope(value) if key in ("rope_scaling", "rope_parameters") else value
             for key, value in text.items() if value is not None or key == "sliding_window"}
    top, inner = raw.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if tie_either:
        tied = {"tie_word_embeddings": bool(top) or bool(inner)}
    else:
        tied = {"tie_word_embeddings": top} if top is not None else {}
    return {**defaults[model_type], **inherited, **given, **tied, **_multimodal_facts(raw, text),
            "model_type": model_type, "architectures": raw["architectures"]}


def _multimodal_facts(raw: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """What the text model never reads but a GGUF export of it records (llama.cpp's converter): the multimodal RoPE
    sections ("mrope_section") and the count of layers the vision tower feeds (Qwen3-VL's "deepstack_layers")."""
    facts: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            facts["mrope_section"] = list(rope["mrope_section"])
    deepstack = (raw.get("vision_config") or {}).get("deepstack_visual_indexes")
    if isinstance(deepstack, list):
        facts["deepstack_layers"] = len(deepstack)
    return facts


def refuse_prequantized(raw: dict[str, Any], source: str) -> None:
    """Raise ModelLoadError (one line) for a checkpoint with a quantization_config: its layout is not checked yet."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: pre-quantized {raw['architectures'][0]} checkpoints are not supported "
                             "text-only; use the float checkpoint (--quant_type quantizes it at load)")


def _without_mrope(rope: Any) -> Any:
    """A rope settings dict with multimodal RoPE's sections dropped ("mrope" read as "default")."""
    if not isinstance(rope, dict):
        return rope
    plain = {key: value for key, value in rope.items() if key not in ("mrope_section", "mrope_interleaved")}
    for key in ("type", "rope_type"):
        if plain.get(key) == "mrope":
            plain[key] = "default"
    return plain


def language_weights(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The language model's checkpoint tensors under the text family's names; the vision tower's and the
    projector's are skipped."""
    for name, tensor in weights:
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, ours in LANGUAGE_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        yield name, tensor


class TextOnly:
    """Mixin before a text family's class: parse_config reads `text_config` (over TEXT_DEFAULTS, keyed by the
    language model's model_type) and load_weights takes the language model's tensors (module docstring)."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {}
    FLAT_TEXT_TYPE: ClassVar[str | None] = None  # text_config()'s flat_type
    TIE_EITHER: ClassVar[bool] = False  # text_config()'s tie_either

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """config.json -> the text family's config of `text_config` (text_config())."""
        text = text_config(raw, cls.TEXT_DEFAULTS, source, cls.FLAT_TEXT_TYPE, cls.TIE_EITHER)
        return super().parse_config(text, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The text family's load_weights on the language model's tensors (language_weights())."""
        return super().load_weights(language_weights(weights))


class Gemma3ForConditionalGeneration(TextOnly, Gemma3ForCausalLM):
    """Gemma 3 4B / 12B / 27B text-only: Gemma 3's decoder of `text_config` (transformers' Gemma3TextConfig sizes
    where the Hub's config.json leaves them out)."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
    }}


class Mistral3ForConditionalGeneration(TextOnly, MistralForCausalLM):
    """Mistral Small 3.1 / 3.2 and Ministral 3 text-only: Mistral's decoder of `text_config` (transformers'
    MistralConfig defaults where config.json leaves a field out, its 4096-token window included), or Ministral 3's
    (`ministral3`: its position-scaled queries, Ministral3Config's defaults)."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6},
        "ministral3": {},  # Ministral3ForCausalLM.parse_config applies Ministral3Config's
    }
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()  # GPTQ / AWQ of the wrapped layout: not checked yet

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """The language model's config (Mistral's or Ministral 3's parser on text_config()); a pre-quantized
        checkpoint is refused (quantize at load with --quant_type)."""
        refuse_prequantized(raw, source)
        text = text_config(raw, cls.TEXT_DEFAULTS, source)
        family = Ministral3ForCausalLM if text["model_type"] == "ministral3" else MistralForCausalLM
        return family.parse_config(text, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> LlamaModel:
        """Ministral 3's stack for a ministral3 language model, else Mistral's."""
        if config.model_type == "ministral3":
            return Ministral3Model(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        return super().build_stack(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)


_QWEN_VL_TEXT = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                 "rms_norm_eps": 1e-5, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 80,
                 "bos_token_id": 151643, "eos_token_id": 151645}


class Qwen2VLForConditionalGeneration(TextOnly, Qwen2ForCausalLM):
    """Qwen2-VL text-only: Qwen2's decoder (transformers' Qwen2VLTextConfig defaults), its fields nested in
    `text_config` (transformers 5) or listed at the top level (the Hub's files); multimodal RoPE is plain RoPE on text.
    Checkpoints name the language model `model.` (the Hub's) or `model.language_model.` and the vision tower
    `visual.` / `model.visual.`."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"qwen2_vl_text": _QWEN_VL_TEXT}
    FLAT_TEXT_TYPE: ClassVar[str | None] = "qwen2_vl_text"
    TIE_EITHER: ClassVar[bool] = True
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (transformers' name)
    """Qwen2.5-VL text-only (3B, 7B, 32B, 72B): as Qwen2-VL (Qwen2_5_VLTextConfig's defaults are Qwen2-VL's)."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"qwen2_5_vl_text": _QWEN_VL_TEXT}
    FLAT_TEXT_TYPE: ClassVar[str | None] = "qwen2_5_vl_text"


class Qwen3VLForConditionalGeneration(TextOnly, Qwen3ForCausalLM):
    """Qwen3-VL text-only (2B-32B dense): Qwen3's decoder (per-head q / k norms) of `text_config` over transformers'
    Qwen3VLTextConfig defaults; interleaved multimodal RoPE is plain RoPE on text, and the vision features it adds to
    early layers (deepstack) exist only with an image."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"qwen3_vl_text": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
    }}
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()


class Qwen3VLMoeForConditionalGeneration(TextOnly, Qwen3MoeForCausalLM):
    """Qwen3-VL-30B-A3B / 235B-A22B (Instruct, Thinking) text-only: Qwen3-MoE's decoder of `text_config` over
    transformers' Qwen3VLMoeTextConfig defaults, whose router always renormalizes the top-k weights and whose
    attention never slides. The experts come fused per layer: `mlp.experts.gate_up_proj` and `down_proj`, transposed
    on the Hub ((E, hidden, 2 x moe_intermediate), (E, moe_intermediate, hidden)) and as flashllm stacks them in what
    transformers 5 saves unconverted ((E, 2 x moe_intermediate, hidden), (E, hidden, moe_intermediate))."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"qwen3_vl_moe_text": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
    }}  # tie_word_embeddings: Qwen3VLMoeConfig's (False), by which transformers 5 ties, where neither level states it
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """Qwen3-MoE's parser on text_config(), top-k renormalized and no sliding window whatever the file says (as
        transformers' Qwen3-VL-MoE computes); a pre-quantized checkpoint is refused."""
        refuse_prequantized(raw, source)
        text = text_config(raw, cls.TEXT_DEFAULTS, source)
        fixed = {"norm_topk_prob": True, "sliding_window": None, "use_sliding_window": False}
        text = {key: value for key, value in text.items() if key != "layer_types"}
        text.setdefault("num_experts", text.get("num_local_experts", 60))  # transformers 5 saves the latter
        return Qwen3MoeForCausalLM.parse_config({**text, **fixed}, source)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """TextOnly's load_weights with the Hub's transposed fused experts turned to flashllm's stacking."""
        return super().load_weights(stacked_experts(weights, self.config.hidden_size,
                                                    self.config.moe_intermediate_size))


def stacked_experts(weights: Iterable[tuple[str, Tensor]], hidden: int, inter: int,
                    marker: str = ".mlp.experts.") -> Iterator[tuple[str, Tensor]]:
    """Each fused expert tensor (`gate_up_proj` / `down_proj` of a module whose name holds `marker`) as (E, out, in):
    transposed where its shape is not that already, as transformers decides (a tensor whose two last sizes are equal
    reads as already stacked). hidden, inter: the model's and each expert's intermediate features."""
    stacked = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    for name, tensor in weights:
        expected = stacked.get(name.rpartition(".")[2]) if marker in name else None
        if expected is not None and tuple(tensor.shape[1:]) != expected:
            tensor = materialize(tensor).transpose(1, 2)  # read whole: each rank's slice is strided
        yield name, tensor
