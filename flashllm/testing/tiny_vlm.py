"""Tiny random-weight vision-language checkpoints (each VLM_PRESETS family) written by transformers, for the text-only tests:
a tiny language model of the matching preset beside a one-layer vision tower."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashllm.testing.tiny_models import PRESETS, TINY_BASE, TINY_INIT_STD

_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": 256}
# model_type -> (the text preset, the language model's model_type, a one-layer vision tower, top-level fields)
VLM_PRESETS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "gemma3": ("gemma3", "gemma3_text",
               {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": 28, "patch_size": 14},
               {"mm_tokens_per_image": 4, "image_token_index": 255, "boi_token_index": 253, "eoi_token_index": 254}),
    "mistral3": ("llama", "mistral",
                 {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "head_dim": 16, "image_size": 28, "patch_size": 14},
                 {"image_token_index": 255, "spatial_merge_size": 1}),
    # Qwen-VL: multimodal RoPE sections summing to half the head (16 / 2 = 2 + 3 + 3; Qwen3's 32 / 2 interleaved)
    "qwen2_vl": ("qwen2", "qwen2_vl_text",
                 {"depth": 1, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2, "patch_size": 14},
                 {"image_token_id": 255, "video_token_id": 254, "vision_start_token_id": 253,
                  "vision_end_token_id": 252}),
    "qwen2_5_vl": ("qwen2", "qwen2_5_vl_text",
                   {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                    "fullatt_block_indexes": [0], "patch_size": 14, "window_size": 56},
                   {"image_token_id": 255, "video_token_id": 254, "vision_start_token_id": 253,
                    "vision_end_token_id": 252}),
    "qwen3_vl": ("qwen3", "qwen3_vl_text",
                 {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 16, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
                 {"image_token_id": 255, "video_token_id": 254, "vision_start_token_id": 253,
                  "vision_end_token_id": 252}),
    # Qwen3-VL-MoE: Qwen3-VL's vision tower; its language model gets MOE_TEXT's experts
    "qwen3_vl_moe": ("qwen3", "qwen3_vl_moe_text",
                     {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                      "patch_size": 16, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
                     {"image_token_id": 255, "video_token_id": 254, "vision_start_token_id": 253,
                      "vision_end_token_id": 252}),
    # Llama 4 (Scout / Maverick): the llama4 text preset (MoE included) beside a one-layer vision model
    "llama4": ("llama4", "llama4_text",
               {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": 28, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32,
                "projector_output_dim": 32},
               {"image_token_index": 255, "boi_token_index": 253, "eoi_token_index": 254}),
}
# LLaVA / LLaVA-NeXT: a CLIP vision tower; the language model Llama's unless text_overrides name another model_type
_CLIP = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32}
VLM_PRESETS["llava"] = ("llama", "llama", _CLIP, {"image_token_index": 255})
VLM_PRESETS["llava_next"] = ("llama", "llama", _CLIP, {"image_token_index": 255, "image_grid_pinpoints": [[28, 28]]})
# GLM-4.1V / GLM-4.5V: a one-block vision tower; RoPE over half of each 16-wide head, 4 frequencies in 3 sections
_GLM4V_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                 "patch_size": 14, "image_size": 28, "spatial_merge_size": 2}
_GLM4V_IDS = {"image_token_id": 255, "video_token_id": 254, "image_start_token_id": 253, "image_end_token_id": 252,
              "video_start_token_id": 251, "video_end_token_id": 250}
VLM_PRESETS["glm4v"] = ("llama", "glm4v_text", _GLM4V_VISION, _GLM4V_IDS)
VLM_PRESETS["glm4v_moe"] = ("llama", "glm4v_moe_text", _GLM4V_VISION, _GLM4V_IDS)
# InternVL (Qwen2 text unless overridden), Idefics3 / SmolVLM (Llama), Aya Vision / Command A Vision (Cohere 2)
_VIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "image_size": 28, "patch_size": 14}
VLM_PRESETS["internvl"] = ("llama", "qwen2", _VIT, {"image_token_id": 255})
VLM_PRESETS["idefics3"] = ("llama", "llama", _VIT, {"image_token_id": 255, "scale_factor": 2})
VLM_PRESETS["smolvlm"] = ("llama", "llama", _VIT, {"image_token_id": 255, "scale_factor": 2})
VLM_PRESETS["aya_vision"] = ("cohere2", "cohere2", {**_VIT, "model_type": "siglip_vision_model"},
                             {"image_token_index": 255, "downsample_factor": 2})
VLM_PRESETS["cohere2_vision"] = ("cohere2", "cohere2", {**_VIT, "model_type": "siglip_vision_model"},
                                 {"image_token_id": 255, "downsample_factor": 2})
# the MoE fields of a MoE language model: top-2 of 8 experts, layer 1 dense; 2 x 48 and 48 differ from hidden (64),
# so the Hub's transposed fused experts cannot pass for transformers 5's
MOE_TEXT = {"qwen3_vl_moe": {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 48, "mlp_only_layers": [1]}}
# the rope settings each Qwen-VL text config carries
MROPE = {"qwen2_vl": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
         "qwen2_5_vl": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
         "qwen3_vl": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True,
                      "rope_theta": 10000.0}}
MROPE["qwen3_vl_moe"] = MROPE["qwen3_vl"]
MROPE["glm4v"] = MROPE["glm4v_moe"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5}
# GLM-4.5V's experts: DeepSeek-V3's routing (top-3 of 8 within the best of 2 groups, scaled by 1.5), one shared
# expert, layer 0 dense
MOE_TEXT["glm4v_moe"] = {"num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 3,
                         "moe_intermediate_size": 48, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                         "topk_group": 1, "routed_scaling_factor": 1.5}


# Ministral 3's language model: YaRN x16 past an original context of 16, so its query scaling steps up within tests
MINISTRAL3_TEXT = {"model_type": "ministral3", "head_dim": 16, "sliding_window": None,
                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                       "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}}


def build_tiny_vlm(out_dir: str | Path, vlm_type: str, *, seed: int = 0, original_format: bool = True,
                   hub_experts: bool = False, **text_overrides: Any) -> Path:
    """Save a tiny `vlm_type` (a VLM_PRESETS key) vision-language model with random weights (norm scales around
    1, the rest N(0, TINY_INIT_STD)); original_format=False keeps transformers 5's `model.language_model.` names
    instead of the Hub's `language_model.model.`. text_overrides replace fields of its text config (MINISTRAL3_TEXT
    makes a Mistral 3 checkpoint Ministral 3's). hub_experts: fused MoE experts written transposed, as the Hub's
    Qwen3-VL-MoE files hold them (transformers 5 saves them as it computes with them)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    preset, text_type, vision, top = VLM_PRESETS[vlm_type]
    text = {**TINY_BASE, **PRESETS[preset][1], **MOE_TEXT.get(vlm_type, {}), **_IDS, "model_type": text_type,
            **text_overrides}
    if vlm_type in MROPE:
        text.setdefault("rope_parameters", MROPE[vlm_type])
    config = AutoConfig.for_model(vlm_type, text_config=text, vision_config=vision, **top)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen) * TINY_INIT_STD
            param.copy_(noise + 1.0 if "norm" in name else noise)
    model.save_pretrained(out_dir, save_original_format=original_format)
    if hub_experts:
        _transpose_fused_experts(Path(out_dir) / "model.safetensors")
    return Path(out_dir)


def _transpose_fused_experts(path: Path) -> None:
    """Rewrite `path` with each `mlp.experts.gate_up_proj` / `down_proj` (E, out, in) as the Hub's (E, in, out)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    save_file({name: t.transpose(1, 2).contiguous() if name.endswith(fused) else t for name, t in tensors.items()},
              path, metadata={"format": "pt"})


def check_text_only_against_transformers(model_dir: Path, prompts: list[list[int]], steps: int = 8) -> None:
    """Serve `model_dir` (a tiny vision-language checkpoint) text-only on the CPU in float32 and check it against
    transformers' vision-language class: no vision or projector parameter is built, the LM head is tied as
    transformers ties it, and the greedy tokens and logits match (check_engine_greedy_against)."""
    from transformers import AutoModelForImageTextToText

    from flashllm.llm import LLM
    from flashllm.testing.parity import check_engine_greedy_against

    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    ours = llm.engine.parts.model
    assert not any("vision" in name or "projector" in name for name, _ in ours.named_parameters())
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    if hasattr(ours, "transformer"):  # GLM-4's decoder keeps ChatGLM's names
        head, embedding = ours.transformer.output_layer, ours.transformer.embedding.word_embeddings
    else:
        head, embedding = ours.lm_head, ours.model.embed_tokens
    assert (head.weight is embedding.weight) == hf.config.tie_word_embeddings  # the top level's
    check_engine_greedy_against(llm, hf, prompts, steps)
