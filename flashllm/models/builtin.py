"""Built-in model architectures, registered through the same hook plugins use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashllm.registry.hookspecs import hookimpl

BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "flashllm.models.llama:LlamaForCausalLM",
    "MinistralForCausalLM": "flashllm.models.mistral:MinistralForCausalLM",
    "MistralForCausalLM": "flashllm.models.mistral:MistralForCausalLM",
    "MixtralForCausalLM": "flashllm.models.mixtral:MixtralForCausalLM",
    "GptOssForCausalLM": "flashllm.models.gpt_oss:GptOssForCausalLM",
    "PhiForCausalLM": "flashllm.models.phi:PhiForCausalLM",  # phi-1, phi-1_5, phi-2
    "GPTJForCausalLM": "flashllm.models.gptj:GPTJForCausalLM",  # GPT-J-6B, GPT4All-J, Pygmalion-6B
    "CodeGenForCausalLM": "flashllm.models.gptj:CodeGenForCausalLM",  # Salesforce CodeGen 350M..16B
    "GPTNeoXForCausalLM": "flashllm.models.gpt_neox:GPTNeoXForCausalLM",  # Pythia, GPT-NeoX-20B, Dolly v2
    "BloomForCausalLM": "flashllm.models.bloom:BloomForCausalLM",  # BLOOM 560m..176B, BLOOMZ
    "MptForCausalLM": "flashllm.models.mpt:MptForCausalLM",  # transformers' name
    "MPTForCausalLM": "flashllm.models.mpt:MptForCausalLM",  # MosaicML's mpt-7b / mpt-30b config.json name
    "FalconForCausalLM": "flashllm.models.falcon:FalconForCausalLM",  # Falcon-7B/40B/180B, Falcon2-11B, Falcon-RW
    "GPTBigCodeForCausalLM": "flashllm.models.gpt_bigcode:GPTBigCodeForCausalLM",  # StarCoder 1, SantaCoder
    "GPT2LMHeadModel": "flashllm.models.gpt2:GPT2LMHeadModel",  # gpt2, distilgpt2, gpt2-medium / large / xl
    "OPTForCausalLM": "flashllm.models.opt:OPTForCausalLM",  # facebook/opt-125m..66b, OPT-IML
    "GPTNeoForCausalLM": "flashllm.models.gpt_neo:GPTNeoForCausalLM",  # EleutherAI gpt-neo-125M / 1.3B / 2.7B
    "XGLMForCausalLM": "flashllm.models.xglm:XGLMForCausalLM",  # facebook/xglm-564M..7.5B
    "Phi3ForCausalLM": "flashllm.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "flashllm.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "flashllm.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "flashllm.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "flashllm.models.qwen3:Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "flashllm.models.qwen3_next:Qwen3NextForCausalLM",
    "Gemma3ForCausalLM": "flashllm.models.gemma3:Gemma3ForCausalLM",
    "Gemma2ForCausalLM": "flashllm.models.gemma3:Gemma2ForCausalLM",
    "GemmaForCausalLM": "flashllm.models.gemma3:GemmaForCausalLM",
    "SmolLM3ForCausalLM": "flashllm.models.smollm3:SmolLM3ForCausalLM",
    "SeedOssForCausalLM": "flashllm.models.seed_oss:SeedOssForCausalLM",
    "HunYuanDenseV1ForCausalLM": "flashllm.models.hunyuan:HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM": "flashllm.models.hunyuan_moe:HunYuanMoEV1ForCausalLM",  # Hunyuan-A13B
    "Starcoder2ForCausalLM": "flashllm.models.starcoder2:Starcoder2ForCausalLM",
    "ArceeForCausalLM": "flashllm.models.arcee:ArceeForCausalLM",
    "NemotronForCausalLM": "flashllm.models.nemotron:NemotronForCausalLM",
    "OlmoeForCausalLM": "flashllm.models.olmoe:OlmoeForCausalLM",
    "StableLmForCausalLM": "flashllm.models.stablelm:StableLmForCausalLM",
    "Ministral3ForCausalLM": "flashllm.models.ministral3:Ministral3ForCausalLM",
    # vision-language checkpoints served text-only
    "Gemma3ForConditionalGeneration": "flashllm.models.text_only:Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "flashllm.models.text_only:Mistral3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "flashllm.models.text_only:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "flashllm.models.text_only:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "flashllm.models.text_only:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "flashllm.models.text_only:Qwen3VLMoeForConditionalGeneration",
    "LlavaForConditionalGeneration": "flashllm.models.text_only_more:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "flashllm.models.text_only_more:LlavaNextForConditionalGeneration",
    "Glm4vForConditionalGeneration": "flashllm.models.text_only_more:Glm4vForConditionalGeneration",  # GLM-4.1V
    "Glm4vMoeForConditionalGeneration": "flashllm.models.text_only_more:Glm4vMoeForConditionalGeneration",  # 4.5V
    "InternVLForConditionalGeneration": "flashllm.models.text_only_more:InternVLForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "flashllm.models.text_only_more:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "flashllm.models.text_only_more:SmolVLMForConditionalGeneration",
    "AyaVisionForConditionalGeneration": "flashllm.models.text_only_more:AyaVisionForConditionalGeneration",
    "Cohere2VisionForConditionalGeneration": "flashllm.models.text_only_more:Cohere2VisionForConditionalGeneration",
    "OlmoForCausalLM": "flashllm.models.olmo:OlmoForCausalLM",  # OLMo-1B/7B-hf, OLMo-7B-0424/0724-hf
    "Olmo2ForCausalLM": "flashllm.models.olmo2:Olmo2ForCausalLM",
    "HeliumForCausalLM": "flashllm.models.helium:HeliumForCausalLM",  # kyutai/helium-1-2b
    "ApertusForCausalLM": "flashllm.models.apertus:ApertusForCausalLM",  # swiss-ai/Apertus-8B / 70B
    "Olmo3ForCausalLM": "flashllm.models.olmo2:Olmo3ForCausalLM",
    "Exaone4ForCausalLM": "flashllm.models.exaone4:Exaone4ForCausalLM",
    "CohereForCausalLM": "flashllm.models.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": "flashllm.models.cohere:Cohere2ForCausalLM",
    "GraniteForCausalLM": "flashllm.models.granite:GraniteForCausalLM",
    "GraniteMoeForCausalLM": "flashllm.models.granite_moe:GraniteMoeForCausalLM",
    "PersimmonForCausalLM": "flashllm.models.persimmon:PersimmonForCausalLM",
    "Lfm2ForCausalLM": "flashllm.models.lfm2:Lfm2ForCausalLM",  # LiquidAI/LFM2-*
    "Lfm2MoeForCausalLM": "flashllm.models.lfm2_moe:Lfm2MoeForCausalLM",  # LiquidAI/LFM2-8B-A1B
    "Mamba2ForCausalLM": "flashllm.models.mamba2:Mamba2ForCausalLM",  # state-spaces/mamba2-*, Mamba-Codestral
    "BambaForCausalLM": "flashllm.models.bamba:BambaForCausalLM",  # ibm-ai-platform/Bamba-9B (v1, v2)
    "GraniteMoeHybridForCausalLM": "flashllm.models.granite_moe_hybrid:GraniteMoeHybridForCausalLM",  # Granite 4.0-H
    "NemotronHForCausalLM": "flashllm.models.nemotron_h:NemotronHForCausalLM",  # Nemotron-H, Nemotron Nano 2
    "GraniteMoeSharedForCausalLM": "flashllm.models.granite_moe:GraniteMoeSharedForCausalLM",
    "QWenLMHeadModel": "flashllm.models.qwen:QWenLMHeadModel",  # first-generation Qwen
    "ChatGLMModel": "flashllm.models.chatglm:ChatGLMForConditionalGeneration",
    "ChatGLMForConditionalGeneration": "flashllm.models.chatglm:ChatGLMForConditionalGeneration",
    "GlmForCausalLM": "flashllm.models.chatglm:GlmForCausalLM",
    "Glm4ForCausalLM": "flashllm.models.chatglm:Glm4ForCausalLM",
    "Glm4MoeForCausalLM": "flashllm.models.glm4_moe:Glm4MoeForCausalLM",  # GLM-4.5 / 4.6
    "Dots1ForCausalLM": "flashllm.models.dots1:Dots1ForCausalLM",  # rednote-hilab dots.llm1
    "AfmoeForCausalLM": "flashllm.models.afmoe:AfmoeForCausalLM",  # Arcee Trinity Nano / Mini / Large
    "SolarOpenForCausalLM": "flashllm.models.solar_open:SolarOpenForCausalLM",  # upstage Solar-Open-100B
    "MiniMaxM2ForCausalLM": "flashllm.models.minimax_m2:MiniMaxM2ForCausalLM",  # MiniMaxAI MiniMax-M2 / M2.1
    "ExaoneMoeForCausalLM": "flashllm.models.exaone_moe:ExaoneMoeForCausalLM",  # LG AI K-EXAONE
    "PhimoeForCausalLM": "flashllm.models.phimoe:PhimoeForCausalLM",  # transformers' name
    "PhiMoEForCausalLM": "flashllm.models.phimoe:PhimoeForCausalLM",  # Phi-3.5-MoE-instruct's config.json
    "DbrxForCausalLM": "flashllm.models.dbrx:DbrxForCausalLM",  # databricks/dbrx-base, dbrx-instruct
    "Llama4ForCausalLM": "flashllm.models.llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "flashllm.models.llama4:Llama4ForConditionalGeneration",  # Scout / Maverick
    "Ernie4_5ForCausalLM": "flashllm.models.ernie4_5:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "flashllm.models.ernie4_5:Ernie4_5_MoeForCausalLM",
    "BaichuanForCausalLM": "flashllm.models.baichuan:BaichuanForCausalLM",
    "BaiChuanForCausalLM": "flashllm.models.baichuan:BaichuanForCausalLM",  # Baichuan-7B
    "DeepseekV2ForCausalLM": "flashllm.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "flashllm.models.deepseek:DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM": "flashllm.models.deepseek:DeepseekV3ForCausalLM",  # GLM-4.7-Flash: V3's MLA and MoE
    "MiniCPM3ForCausalLM": "flashllm.models.minicpm3:MiniCPM3ForCausalLM",  # openbmb/MiniCPM3-4B: MLA, scaled
    "FlexOlmoForCausalLM": "flashllm.models.flex_olmo:FlexOlmoForCausalLM",  # OLMo 2 norms around OLMoE's MoE
    "CwmForCausalLM": "flashllm.models.cwm:CwmForCausalLM",  # Meta's Code World Model: Llama + sliding layers
    "MambaForCausalLM": "flashllm.models.mamba:MambaForCausalLM",  # selective state spaces, no attention
    "FalconMambaForCausalLM": "flashllm.models.mamba:FalconMambaForCausalLM",  # Mamba + RMS-normed dt, B, C
    "JambaForCausalLM": "flashllm.models.jamba:JambaForCausalLM",  # Mamba + attention layers, MoE MLPs
}


@hookimpl
def flashllm_register_models(register: Callable[[str, Any], None]) -> None:
    """Register flashllm's own architectures lazily (modules import on first use)."""
    for architecture, target in BUILTIN_MODELS.items():
        register(architecture, target)
