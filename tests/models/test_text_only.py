"""Vision-language checkpoints served text-only (Gemma 3, Mistral 3, Qwen-VL dense and MoE, tiny and random): the language model's
tokens and logits equal transformers' full vision-language model on text prompts, in the Hub's and transformers 5's
checkpoint layouts, the vision tower is never loaded, and config.json's text_config reads as transformers reads it."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_vlm import MINISTRAL3_TEXT, build_tiny_vlm, check_text_only_against_transformers

VOCAB = 256
PROMPTS = [random_tokens(n, VOCAB, seed=n) for n in (3, 40, 70)]


@pytest.mark.parametrize("original_format", [True, False], ids=["hub", "transformers5"])
@pytest.mark.parametrize(("model_type", "overrides"), [
    ("gemma3", {}), ("mistral3", {"sliding_window": 8}), ("mistral3", MINISTRAL3_TEXT), ("qwen2_vl", {}),
    ("qwen2_5_vl", {}), ("qwen3_vl", {}), ("qwen3_vl_moe", {}),
], ids=["gemma3", "mistral3", "ministral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_the_language_model_matches_transformers_on_text(model_type, overrides, original_format, tmp_path) -> None:
    model_dir = build_tiny_vlm(tmp_path, model_type, seed=3, original_format=original_format, **overrides)
    check_text_only_against_transformers(model_dir, PROMPTS)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_vlm(tmp_path, "mistral3", seed=2, original_format=False)
    two_ranks_decode_as_one(PROMPTS[:2], model_dir)


def test_the_hub_s_transposed_fused_experts_load_as_transformers_reads_them(tmp_path) -> None:
    """Qwen3-VL-MoE on the Hub: gate_up_proj (E, hidden, 2I) and down_proj (E, I, hidden), transposed to flashllm's."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    model_dir = build_tiny_vlm(tmp_path, "qwen3_vl_moe", seed=5, hub_experts=True)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 64, 96]
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, PROMPTS, 8)


@pytest.mark.parametrize("hub_experts", [True, False], ids=["hub_experts", "stacked_experts"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_two_ranks_slice_qwen3_vl_moe_s_fused_experts(hub_experts, expert_parallel, tmp_path) -> None:
    model_dir = build_tiny_vlm(tmp_path, "qwen3_vl_moe", seed=6, hub_experts=hub_experts)
    two_ranks_decode_as_one(PROMPTS[:2], model_dir, enable_expert_parallel=expert_parallel)


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


# the Hub's Qwen3-VL-30B-A3B-Instruct and the text_config sizes of Qwen3-VL-235B-A22B (bare: transformers' defaults)
HUB_QWEN3VLMOE = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
                  "torch_dtype": "bfloat16", "tie_word_embeddings": False,
                  "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048, "intermediate_size": 6144,
                                  "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 4,
                                  "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                                  "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
                                  "norm_topk_prob": True, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                                  "rope_theta": 5000000, "vocab_size": 151936, "attention_bias": False,
                                  "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                                   "rope_type": "default"}},
                  "vision_config": {"depth": 27, "out_hidden_size": 2048}}
QWEN3VLMOE_235B = {"model_type": "qwen3_vl_moe_text", "hidden_size": 4096, "intermediate_size": 12288,
                   "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 94,
                   "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8}
QWEN3VLMOE_VARIANTS = [HUB_QWEN3VLMOE, {**HUB_QWEN3VLMOE, "text_config": QWEN3VLMOE_235B},
                       {**HUB_QWEN3VLMOE, "tie_word_embeddings": True,
                        "text_config": {"model_type": "qwen3_vl_moe_text", "mlp_only_layers": [0, 3],
                                        "decoder_sparse_step": 2, "norm_topk_prob": False}},
                       {"architectures": HUB_QWEN3VLMOE["architectures"], "model_type": "qwen3_vl_moe",
                        "text_config": {"model_type": "qwen3_vl_moe_text", "num_experts": 16}}]


@pytest.mark.parametrize("raw", [HUB_GEMMA3, HUB_MISTRAL3, HUB_QWEN25VL, HUB_QWEN3VLMOE],
                         ids=["gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl_moe"])
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


@pytest.mark.parametrize("raw", QWEN3VLMOE_VARIANTS, ids=["30b_a3b", "235b_a22b", "defaults_sparse_step", "bare"])
def test_qwen3_vl_moe_s_experts_read_as_transformers_reads_them(raw) -> None:
    """Experts, top-k and the dense layers as Qwen3VLMoeTextConfig reads them; its router renormalizes the top-k
    whatever norm_topk_prob says, and no layer slides."""
    from transformers import AutoConfig

    ours = parse_hf_config(raw)
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    top = AutoConfig.for_model(raw["model_type"], **fields)
    theirs = top.get_text_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.sparse_layers == tuple(i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0
                                       for i in range(theirs.num_hidden_layers))
    assert ours.norm_topk_prob and ours.sliding_windows == (None,) * theirs.num_hidden_layers
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == top.tie_word_embeddings  # the level transformers 5 ties by


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
    ({**HUB_QWEN3VLMOE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "pre-quantized Qwen3VLMoe"),
    ({**HUB_QWEN3VLMOE, "text_config": {**HUB_QWEN3VLMOE["text_config"], "model_type": "qwen3_vl_text"}},
     "text_config.model_type='qwen3_vl_text'"),
])
def test_what_it_cannot_serve_is_refused_in_one_line(change, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**HUB_GEMMA3, **change})
    assert "\n" not in str(info.value)
