"""Vision-language checkpoints served text-only (Gemma 3 and Mistral 3, tiny and random): the language model's
tokens and logits equal transformers' full vision-language model on text prompts, in the Hub's and transformers 5's
checkpoint layouts, the vision tower is never loaded, and config.json's text_config reads as transformers reads it."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_vlm import MINISTRAL3_TEXT, build_tiny_vlm

VOCAB = 256
PROMPTS = [random_tokens(n, VOCAB, seed=n) for n in (3, 40, 70)]


@pytest.mark.parametrize("original_format", [True, False], ids=["hub", "transformers5"])
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("gemma3", {}), ("mistral3", {"sliding_window": 8}), ("mistral3", MINISTRAL3_TEXT), ("qwen2_vl", {}),
    ("qwen2_5_vl", {}), ("qwen3_vl", {}),
], ids=["gemma3", "mistral3", "ministral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_language_model_matches_transformers_on_text(model_type, overrides, original_format, tmp_path) -> None:
    from transformers import AutoModelForImageTextToText

    model_dir = build_tiny_vlm(tmp_path, model_type, seed=3, original_format=original_format, **overrides)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    ours = llm.engine.parts.model
    assert not any("vision" in name or "projector" in name for name, _ in ours.named_parameters())
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings  # the top level's
    check_engine_greedy_against(llm, hf, PROMPTS, 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_vlm(tmp_path, "mistral3", seed=2, original_format=False)
    two_ranks_decode_as_one(PROMPTS[:2], model_dir)


# the text_config a Hub config.json writes: only the fields that differ from the text config class's defaults
HUB_GEMMA3 = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model"}}
HUB_MISTRAL3 = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                "text_config": {"head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                                "model_type": "mistral", "num_hidden_layers": 40, "rope_theta": 1e9,
                                "sliding_window": None, "vocab_size": 131072},
                "vision_config": {"model_type": "pixtral"}}


# the Hub's Qwen2.5-VL-7B layout: the language model's fields at the top level, multimodal RoPE sections
HUB_QWEN25VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
                "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 28,
                "tie_word_embeddings": False, "vocab_size": 152064, "torch_dtype": "bfloat16",
                "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584}}


@pytest.mark.parametrize("raw", [HUB_GEMMA3, HUB_MISTRAL3, HUB_QWEN25VL], ids=["gemma3", "mistral3", "qwen2_5_vl"])
def test_a_hub_text_config_reads_as_transformers_reads_it(raw) -> None:
    from transformers import AutoConfig

    ours = parse_hf_config(raw)
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    top = AutoConfig.for_model(raw["model_type"], **fields)
    theirs = top.get_text_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # the level transformers 5 ties by; where the Hub's Mistral 3 file states none, transformers 5 would tie by its
    # default (True) and drop the checkpoint's head (its issue 42313): the text config's value is the one kept here
    expected = top.tie_word_embeddings if "tie_word_embeddings" in raw or raw is not HUB_MISTRAL3 else False
    assert ours.tie_word_embeddings == expected
    assert ours.head_dim == getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    layer_types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    windows = tuple(theirs.sliding_window if kind == "sliding_attention" else None for kind in layer_types)
    assert ours.sliding_windows == windows and ours.architecture == raw["architectures"][0]
    rope = theirs.rope_parameters.get("full_attention", theirs.rope_parameters)  # Gemma 3's per layer type
    assert ours.rope_theta == rope["rope_theta"]
    assert ours.torch_dtype == (torch.bfloat16 if "torch_dtype" in raw else None)


def test_ministral3_queries_scale_past_the_original_context(tmp_path) -> None:
    """The scaling is 1 within the original context (16) and 1 + beta ln(1 + floor(p / 16)) past it."""
    model_dir = build_tiny_vlm(tmp_path, "mistral3", seed=4, **MINISTRAL3_TEXT)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    attn = llm.engine.parts.model.model.layers[0].self_attn
    assert (attn.beta, attn.original) == (0.5, 16)


def test_the_head_is_tied_as_the_top_level_states_else_as_the_text_config_says() -> None:
    """transformers 5 ties by the top-level field (and saves no lm_head then); the Hub's older Mistral 3 files state
    none at the top and keep an untied head, as their text_config says."""
    untied_text = {**HUB_MISTRAL3["text_config"], "tie_word_embeddings": False}
    assert not parse_hf_config({**HUB_MISTRAL3, "text_config": untied_text}).tie_word_embeddings
    assert parse_hf_config({**HUB_MISTRAL3, "text_config": untied_text, "tie_word_embeddings": True}).tie_word_embeddings
    assert parse_hf_config(HUB_GEMMA3).tie_word_embeddings  # Gemma3TextConfig's default


@pytest.mark.parametrize(("change", "fragment"), [
    ({"text_config": None}, "has no text_config object"),
    ({"text_config": {**HUB_GEMMA3["text_config"], "model_type": "llama"}}, "text_config.model_type='llama'"),
    ({**HUB_MISTRAL3, "quantization_config": {"quant_method": "awq", "bits": 4}}, "pre-quantized Mistral3"),
    ({**HUB_MISTRAL3, "text_config": {**HUB_MISTRAL3["text_config"], "model_type": "qwen2"}},
     "text_config.model_type='qwen2'"),
])
def test_what_it_cannot_serve_is_refused_in_one_line(change, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**HUB_GEMMA3, **change})
    assert "\n" not in str(info.value)
