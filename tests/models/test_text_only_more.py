"""More vision-language checkpoints served text-only (LLaVA, LLaVA-NeXT, GLM-4.1V, GLM-4.5V; tiny and random): the language model's tokens
and logits equal transformers' vision-language model on text prompts in the Hub's and transformers 5's layouts, the
vision tower is never loaded, and text_config reads as transformers reads it."""

from __future__ import annotations

import pytest

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import random_tokens
from flashllm.testing.tiny_vlm import build_tiny_vlm, check_text_only_against_transformers

VOCAB = 256
PROMPTS = [random_tokens(n, VOCAB, seed=n) for n in (3, 40, 70)]
CASES = [("llava", True, {}), ("llava", False, {"model_type": "mistral", "sliding_window": 8}),
         ("llava", True, {"model_type": "qwen2", "tie_word_embeddings": True}),
         ("llava_next", True, {"model_type": "mistral", "sliding_window": None}), ("llava_next", False, {}),
         ("glm4v", True, {}), ("glm4v", False, {"tie_word_embeddings": True}), ("glm4v_moe", True, {}),
         ("glm4v_moe", False, {}), ("internvl", True, {}), ("internvl", False, {"model_type": "qwen3", "head_dim": 32}),
         ("idefics3", True, {}), ("smolvlm", False, {"tie_word_embeddings": True}), ("aya_vision", True, {}),
         ("aya_vision", False, {"model_type": "cohere", "logit_scale": 0.25}), ("cohere2_vision", True, {})]


@pytest.mark.parametrize(("model_type", "original_format", "overrides"), CASES,
                         ids=["llava_llama_hub", "llava_mistral_t5", "llava_qwen2_hub", "next_mistral_hub",
                              "next_llama_t5", "glm4v_hub", "glm4v_tied_t5", "glm4v_moe_hub", "glm4v_moe_t5",
                              "internvl_qwen2_hub", "internvl_qwen3_t5", "idefics3", "smolvlm_tied", "aya_vision_hub",
                              "aya_vision_cohere_t5", "cohere2_vision"])
def test_the_language_model_matches_transformers_on_text(model_type, original_format, overrides, tmp_path) -> None:
    model_dir = build_tiny_vlm(tmp_path, model_type, seed=3, original_format=original_format, **overrides)
    check_text_only_against_transformers(model_dir, PROMPTS)


@pytest.mark.parametrize(("model_type", "overrides", "expert_parallel"), [
    ("llava", {"model_type": "qwen2"}, False), ("glm4v", {}, False), ("glm4v_moe", {}, True), ("idefics3", {}, False),
    ("aya_vision", {}, False), ("internvl", {"model_type": "qwen3", "head_dim": 32}, False)],
    ids=["llava_qwen2", "glm4v", "glm4v_moe_ep", "idefics3", "aya_vision", "internvl_qwen3"])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(model_type, overrides, expert_parallel, tmp_path) -> None:
    model_dir = build_tiny_vlm(tmp_path, model_type, seed=2, **overrides)
    two_ranks_decode_as_one(PROMPTS[:2], model_dir, enable_expert_parallel=expert_parallel)


# the Hub's llava-1.5-7b-hf, llava-v1.6-mistral-7b-hf and llava-interleave-qwen-0.5b-hf text_configs (bare fields
# fall to the text config class's defaults)
HUB_LLAVA = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
             "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                             "vocab_size": 32064, "torch_dtype": "float16"},
             "vision_config": {"model_type": "clip_vision_model"}}
HUB_LLAVA_NEXT = {"architectures": ["LlavaNextForConditionalGeneration"], "model_type": "llava_next",
                  "torch_dtype": "bfloat16",
                  "text_config": {"model_type": "mistral", "intermediate_size": 14336, "max_position_embeddings": 32768,
                                  "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                                  "sliding_window": None, "vocab_size": 32064},
                  "vision_config": {"model_type": "clip_vision_model"}}
HUB_LLAVA_QWEN = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                  "text_config": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                                  "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
                                  "rope_theta": 1e6, "tie_word_embeddings": True, "vocab_size": 152000},
                  "vision_config": {"model_type": "siglip_vision_model"}}

# the Hub's GLM-4.1V-9B-Thinking and GLM-4.5V text_configs (as their config.json writes them, vision left out)
HUB_GLM4V = {"architectures": ["Glm4vForConditionalGeneration"], "model_type": "glm4v",
             "text_config": {"model_type": "glm4v_text", "attention_bias": True, "hidden_size": 4096,
                             "intermediate_size": 13696, "max_position_embeddings": 65536, "num_attention_heads": 32,
                             "num_hidden_layers": 40, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
                             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
                             "vocab_size": 151552, "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]}},
             "vision_config": {"model_type": "glm4v"}}
HUB_GLM4V_MOE = {"architectures": ["Glm4vMoeForConditionalGeneration"], "model_type": "glm4v_moe",
                 "text_config": {"model_type": "glm4v_moe_text", "attention_bias": True, "head_dim": 128,
                                 "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 65536,
                                 "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
                                 "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
                                 "num_key_value_heads": 8, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5,
                                 "rope_theta": 10000.0, "routed_scaling_factor": 1.0, "use_qk_norm": False,
                                 "vocab_size": 151552, "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]}},
                 "vision_config": {"model_type": "glm4v_moe"}}
# the fields Glm4vMoeTextConfig's defaults fill (q / k / v biased, RoPE over half of each head) left out
GLM4V_MOE_UNSTATED = {**HUB_GLM4V_MOE, "text_config": {
    key: value for key, value in HUB_GLM4V_MOE["text_config"].items()
    if key not in ("attention_bias", "partial_rotary_factor", "routed_scaling_factor", "n_routed_experts")}}

# bare text_configs of the other classes, each over its config class's defaults
BARE = [{"architectures": [f"{name}ForConditionalGeneration"], "model_type": model_type,
         "text_config": {"model_type": text_type} if text_type else None}
        for name, model_type, text_type in [("InternVL", "internvl", None), ("InternVL", "internvl", "qwen3"),
                                            ("InternVL", "internvl", "llama"), ("Idefics3", "idefics3", None),
                                            ("SmolVLM", "smolvlm", None), ("AyaVision", "aya_vision", None),
                                            ("AyaVision", "aya_vision", "cohere"),
                                            ("Cohere2Vision", "cohere2_vision", None)]]


@pytest.mark.parametrize("raw", [HUB_LLAVA, HUB_LLAVA_NEXT, HUB_LLAVA_QWEN, {**HUB_LLAVA, "text_config": None},
                                 HUB_GLM4V, {**HUB_GLM4V, "text_config": None}, HUB_GLM4V_MOE, GLM4V_MOE_UNSTATED,
                                 *BARE],
                         ids=["llava_1_5", "llava_next_mistral", "llava_interleave_qwen2", "bare", "glm4v", "glm4v_bare",
                              "glm4v_moe", "glm4v_moe_unstated", "internvl", "internvl_qwen3", "internvl_llama",
                              "idefics3", "smolvlm", "aya_vision", "aya_vision_cohere", "cohere2_vision"])
def test_a_hub_text_config_reads_as_transformers_reads_it(raw) -> None:
    from transformers import AutoConfig

    ours = parse_hf_config({**raw, "text_config": raw["text_config"] or {}})
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    top = AutoConfig.for_model(raw["model_type"], **fields)
    theirs = top.get_text_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    eps = theirs.rms_norm_eps if hasattr(theirs, "rms_norm_eps") else theirs.layer_norm_eps  # Cohere's LayerNorm
    assert ours.rms_norm_eps == eps
    assert ours.head_dim == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    # no top-level value stated: the text config's (LLaVA and GLM-4V carry it up; InternVL's and Aya Vision's
    # top-level default, by which transformers 5 would tie, is not what the Hub's older files mean)
    assert ours.tie_word_embeddings == getattr(theirs, "tie_word_embeddings", False)  # Glm4vTextConfig has none
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    if hasattr(ours, "qkv_bias"):  # GLM's (Glm4vTextAttention always biases q / k / v)
        assert ours.qkv_bias == getattr(theirs, "attention_bias", True)
    assert ours.rotary_dim == int(ours.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    layer_types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    windows = tuple(getattr(theirs, "sliding_window", None) if kind == "sliding_attention" else None for kind in layer_types)
    assert getattr(ours, "sliding_windows", (None,) * ours.num_hidden_layers) == windows and ours.architecture == raw["architectures"][0]


@pytest.mark.parametrize(("change", "fragment"), [
    ({"text_config": {"model_type": "gemma"}}, "text_config.model_type='gemma'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "pre-quantized Llava"),
])
def test_what_it_cannot_serve_is_refused_in_one_line(change, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**HUB_LLAVA, **change})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("raw", "fragment"), [
    ({**HUB_GLM4V, "text_config": {**HUB_GLM4V["text_config"], "head_dim": 64}}, "text_config.head_dim=64 differs"),
    ({**HUB_GLM4V_MOE, "text_config": {}}, "not divisible by num_attention_heads=96"),  # Glm4vMoeTextConfig's own
    ({**HUB_GLM4V_MOE, "quantization_config": {"quant_method": "fp8"}}, "pre-quantized Glm4vMoe"),
])
def test_what_glm4v_cannot_serve_is_refused_in_one_line(raw, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config(raw)
    assert "\n" not in str(info.value)
