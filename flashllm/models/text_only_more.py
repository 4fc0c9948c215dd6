"""More vision-language checkpoints served text-only (text_only.py's mixin and helpers): LLaVA 1.5 and LLaVA-NeXT
(`LlavaForConditionalGeneration`, `LlavaNextForConditionalGeneration`) over a Llama, Mistral or Qwen2 language model,
GLM-4.1V / GLM-4.5V (`Glm4vForConditionalGeneration`, `Glm4vMoeForConditionalGeneration`) over GLM-4's decoder and
GLM-4.5's MoE decoder as transformers' Glm4v text models compute them, InternVL (Qwen2, Qwen3 or Llama text),
Idefics3 / SmolVLM (Llama text) and Aya Vision / Command A Vision (Cohere or Cohere 2 text).

A LLaVA, InternVL, Idefics3 or Aya Vision checkpoint may carry any of several text families (TextFamilies):
`TEXT_FAMILIES` maps the language model's model_type to the flashllm class whose config parser and attention biases
apply; each such class differs from the base class of the text-only class in nothing else.
"""

from __future__ import annotations

from typing import Any, ClassVar

from flashllm.models.chatglm import Glm4ForCausalLM
from flashllm.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from flashllm.models.errors import ModelLoadError
from flashllm.models.glm4_moe import Glm4MoeForCausalLM
from flashllm.models.hf_config import HFModelConfig
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.mistral import MistralForCausalLM
from flashllm.models.qwen2 import Qwen2ForCausalLM
from flashllm.models.qwen3 import Qwen3ForCausalLM
from flashllm.models.text_only import Mistral3ForConditionalGeneration, TextOnly, refuse_prequantized, text_config

# transformers' LlamaConfig and Qwen2Config defaults where a text_config leaves a field out (MistralConfig's are
# Mistral 3's)
LLAMA_TEXT: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
    "eos_token_id": 2}
QWEN2_TEXT: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}
LLAVA_TEXT = {"llama": LLAMA_TEXT, "mistral": Mistral3ForConditionalGeneration.TEXT_DEFAULTS["mistral"],
              "qwen2": QWEN2_TEXT}
# transformers' CohereConfig / Cohere2Config sizes (the Cohere parsers fill the rest)
COHERE_TEXT: dict[str, Any] = {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
                               "num_hidden_layers": 40, "num_attention_heads": 64}


class TextFamilies(TextOnly):
    """Mixin before LlamaForCausalLM or a subclass: the language model is any family of TEXT_FAMILIES (keyed as
    TEXT_DEFAULTS; each a subclass of that base overriding only parse_config / attention_biases), whose config parser
    reads text_config() and whose attention biases the layers take."""

    TEXT_FAMILIES: ClassVar[dict[str, type[LlamaForCausalLM]]] = {}
    FIXED_TEXT: ClassVar[dict[str, Any]] = {}  # fields the vision-language class computes with whatever the file says
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()  # GPTQ / AWQ of the wrapped layout: not checked yet

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """The language model's family's parser on text_config(); a pre-quantized checkpoint is refused (quantize
        at load with --quant_type)."""
        refuse_prequantized(raw, source)
        text = text_config(raw, cls.TEXT_DEFAULTS, source, cls.FLAT_TEXT_TYPE, cls.TIE_EITHER)
        return cls.TEXT_FAMILIES[text["model_type"]].parse_config({**text, **cls.FIXED_TEXT}, source)

    @classmethod
    def attention_biases(cls, config: LlamaModelConfig) -> tuple[bool, bool]:
        """The language model's family's (qkv_proj, o_proj) biases (Qwen2's qkv bias)."""
        return cls.TEXT_FAMILIES[config.model_type].attention_biases(config)


class LlavaForConditionalGeneration(TextFamilies, LlamaForCausalLM):
    """LLaVA 1.5 (llava-hf/llava-1.5-7b / 13b-hf: Vicuna), BakLLaVA (Mistral), LLaVA-Interleave (Qwen2) text-only:
    `text_config` over its family's transformers defaults (LlavaConfig's is Llama's); the head is tied where either
    level says so (LlavaConfig carries the text config's tie up). The Hub's files name the language model
    `language_model.model.` / `language_model.lm_head.`, transformers 5's `model.language_model.` / `lm_head.`."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = LLAVA_TEXT
    TEXT_FAMILIES: ClassVar[dict[str, type[LlamaForCausalLM]]] = {
        "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}
    TIE_EITHER: ClassVar[bool] = True
    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)  # a Mistral language model's


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT / LLaVA 1.6 (llava-v1.6-mistral-7b-hf, -vicuna-7b / 13b-hf, -34b-hf) text-only: as LLaVA, and its
    `image_newline` tensor is never read. LlavaNextConfig ties the head by the top level alone; where that is unstated
    the text config's value is kept, as the saved tensors agree (no published LLaVA-NeXT ties)."""

    TIE_EITHER: ClassVar[bool] = False


class Glm4vForConditionalGeneration(TextOnly, Glm4ForCausalLM):
    """GLM-4.1V-9B (Base, Thinking) text-only: GLM-4-0414's decoder (post-attention and post-MLP norms, interleaved
    RoPE over partial_rotary_factor of each head) of `text_config` over transformers' Glm4vTextConfig defaults, whose
    factor is 1.0 where unstated (GlmConfig's is 0.5). As Glm4vTextAttention computes: q, k and v always biased, a
    head hidden_size / num_attention_heads wide; multimodal RoPE is plain RoPE on text. Head tied where either level
    says so."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"glm4v_text": {
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "partial_rotary_factor": 1.0}}
    TIE_EITHER: ClassVar[bool] = True

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """GLM-4's parser on text_config() with q / k / v biased; a head_dim other than hidden_size /
        num_attention_heads (which transformers' rotary table would read but its attention ignore) is refused."""
        text = text_config(raw, cls.TEXT_DEFAULTS, source, tie_either=True)
        width = text["hidden_size"] // text["num_attention_heads"]
        if text.get("head_dim", width) != width:
            raise ModelLoadError(f"{source}: text_config.head_dim={text['head_dim']} differs from hidden_size / "
                                 f"num_attention_heads = {width}, which GLM-4.1V's attention uses; fix config.json")
        return Glm4ForCausalLM.parse_config({**text, "attention_bias": True}, source)


class Glm4vMoeForConditionalGeneration(TextOnly, Glm4MoeForCausalLM):
    """GLM-4.5V text-only: GLM-4.5's MoE decoder of `text_config` over transformers' Glm4vMoeTextConfig defaults
    (q / k / v biased unless attention_bias is false, no per-head q / k norms, RoPE over half of each head, top-8 of
    128 experts beside one shared one). Experts per expert (the Hub's) or stacked (transformers 5's); multimodal RoPE
    is plain RoPE on text. Head tied where either level says so."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"glm4v_moe_text": {
        "vocab_size": 151424, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
        "attention_bias": True, "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True}}
    TIE_EITHER: ClassVar[bool] = True
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> HFModelConfig:
        """GLM-4.5's parser on text_config() without q / k norms (Glm4vMoeTextAttention has none); a pre-quantized
        checkpoint is refused."""
        refuse_prequantized(raw, source)
        text = text_config(raw, cls.TEXT_DEFAULTS, source, tie_either=True)
        return Glm4MoeForCausalLM.parse_config({**text, "use_qk_norm": False}, source)


class InternVLForConditionalGeneration(TextFamilies, LlamaForCausalLM):
    """InternVL 3 / 3.5 in transformers' layout (OpenGVLab/InternVL3-*-hf, InternVL3_5-*-HF) text-only: a Qwen2 (the
    default), Qwen3 or Llama language model of `text_config` over its config class's defaults; the head tied as the
    top level states (InternVLConfig's default: tied), else as the text config says. The original InternVL
    checkpoints (`InternVLChatModel`, remote code) are not this layout."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "qwen2": QWEN2_TEXT, "qwen3": {**QWEN2_TEXT, "head_dim": 128}, "llama": LLAMA_TEXT}
    TEXT_FAMILIES: ClassVar[dict[str, type[LlamaForCausalLM]]] = {
        "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}


class Idefics3ForConditionalGeneration(TextFamilies, LlamaForCausalLM):
    """Idefics3 (HuggingFaceM4/Idefics3-8B-Llama3) text-only: its Llama language model, `model.text_model.`, over
    LlamaConfig's defaults with Idefics3Config's rms_norm_eps 1e-5; `model.vision_model.` and `model.connector.` are
    never read. The head tied as the top level states (default: untied), else as the text config says."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"llama": {**LLAMA_TEXT, "rms_norm_eps": 1e-5}}
    TEXT_FAMILIES: ClassVar[dict[str, type[LlamaForCausalLM]]] = {"llama": LlamaForCausalLM}


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM / SmolVLM2 (256M-2.2B) text-only: Idefics3's layout and defaults."""


class AyaVisionForConditionalGeneration(TextFamilies, CohereForCausalLM):
    """Aya Vision 8B (Cohere 2 text, the default) and 32B (Cohere text) text-only: the Cohere decoder (parallel
    block, LayerNorm, scaled logits; Cohere 2's sliding layers) of `text_config` over its config class's defaults;
    the head tied as the top level states (AyaVisionConfig's default: tied), else as the text config says."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"cohere2": COHERE_TEXT, "cohere": COHERE_TEXT}
    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window",)  # Cohere 2's
    TEXT_FAMILIES: ClassVar[dict[str, type[LlamaForCausalLM]]] = {
        "cohere2": Cohere2ForCausalLM, "cohere": CohereForCausalLM}


class Cohere2VisionForConditionalGeneration(AyaVisionForConditionalGeneration):
    """Command A Vision text-only: Cohere 2's decoder of `text_config`, as Aya Vision 8B's, with unscaled logits: transformers'
    Cohere2VisionForConditionalGeneration applies no `logit_scale` (greedy tokens are the same either way)."""

    TEXT_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"cohere2": COHERE_TEXT}
    FIXED_TEXT: ClassVar[dict[str, Any]] = {"logit_scale": 1.0}
