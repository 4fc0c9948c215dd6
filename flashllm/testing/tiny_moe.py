"""Tiny random-weight Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and other MoE checkpoints written by transformers, for tests of the MoE models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

INIT_STD = 0.1  # routing logits of order one: experts are chosen decisively, and a wrong one shows
MOE_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2}
# preset -> (transformers model_type, architecture, config fields)
MOE_PRESETS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("mixtral", "MixtralForCausalLM",
                {"intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral_top1": ("mixtral", "MixtralForCausalLM",
                     {"intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 1}),
    # layers 1 and 5 sparse (decoder_sparse_step 2; layer 3 listed in mlp_only_layers), the rest dense;
    # top-4 of 8 weights not renormalized, a shared expert beside them
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM",
                  {"intermediate_size": 128, "num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 4,
                   "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "decoder_sparse_step": 2,
                   "mlp_only_layers": [3], "norm_topk_prob": False}),
    "qwen2_moe_top2_renormalized": ("qwen2_moe", "Qwen2MoeForCausalLM",
                                    {"intermediate_size": 128, "num_hidden_layers": 2, "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 80, "norm_topk_prob": True}),
    # top-8 of 12, not renormalized, with a shared expert; every product's input features a multiple of
    # 32, so int8 / int4 experts run on the native kernels (layer 1 dense)
    "qwen2_moe_top8": ("qwen2_moe", "Qwen2MoeForCausalLM",
                       {"intermediate_size": 128, "num_hidden_layers": 3, "num_experts": 12, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96, "mlp_only_layers": [1],
                        "norm_topk_prob": False}),
    # Qwen3-MoE: per-head q / k norms with an explicit head_dim, no shared expert; top-2 of 8 renormalized,
    # layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM",
                  {"intermediate_size": 128, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": True, "head_dim": 24}),
    # GLM-4.5: DeepSeek-V3's routing (sigmoid, correction bias, top-3 of 8 within the best of 2 groups, scaled
    # by 1.5) beside one shared expert; biased q / k / v, per-head q / k norms, RoPE over half of each head;
    # layer 0 dense (first_k_dense_replace)
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM",
                 {"intermediate_size": 128, "num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 3,
                  "moe_intermediate_size": 48, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                  "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.5, "use_qk_norm": True,
                  "attention_bias": True, "head_dim": 24}),
}
# ERNIE 4.5 MoE: softmax scores chosen with a choice bias (moe_statics), top-3 of 8 renormalized, one shared
# expert; layers 1 and 3 sparse (interval 2 from layer 1); RoPE over adjacent pairs; kept apart from MOE_PRESETS
# (no fused decode step: test_moe.py's checks expect one)
ERNIE_MOE_PRESET = ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM",
                    {"intermediate_size": 128, "num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 3,
                     "moe_intermediate_size": 48, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                     "moe_layer_interval": 2, "head_dim": 16, "tie_word_embeddings": False, "rope_theta": 10000.0})
# Granite-MoE: Granite's four multipliers far from 1, top-2 of 4 experts in every layer
GRANITE_MOE_PRESET = ("granitemoe", "GraniteMoeForCausalLM",
                      {"intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                       "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
                       "logits_scaling": 8.0, "tie_word_embeddings": True})
# Granite-MoE-Shared: the Granite-MoE preset with a shared MLP 80 wide beside its experts
GRANITE_MOE_SHARED_PRESET = ("granitemoeshared", "GraniteMoeSharedForCausalLM",
                             {**GRANITE_MOE_PRESET[2], "shared_intermediate_size": 80})
# gpt-oss: top-2 of 4 biased experts (the clamped SwiGLU), per-head sinks, even layers sliding (window 8), YaRN x8
# past an original context of 64 (truncate false, as published), biased attention projections
GPT_OSS_PRESET = ("gpt_oss", "GptOssForCausalLM",
                  {"intermediate_size": 48, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "head_dim": 16, "sliding_window": 8, "attention_bias": True,
                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}})
# OLMoE: OLMo 2's whole-projection q / k norms, top-3 of 8 softmax-scored experts not renormalized, every layer sparse
OLMOE_PRESET = ("olmoe", "OlmoeForCausalLM",
                {"intermediate_size": 48, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 3,
                 "norm_topk_prob": False, "pad_token_id": 0})
# FlexOlmo: OLMoE's experts (top-3 of 8, not renormalized) under OLMo 2's post-norms, no input norm
FLEX_OLMO_PRESET = ("flex_olmo", "FlexOlmoForCausalLM", {**OLMOE_PRESET[2], "rope_theta": 10000.0})
# PhiMoE: LayerNorms, biased attention and LM head, SparseMixer's two picks of 4 experts in a wide band (0.1, so
# several experts share the softmax), LongRoPE past an original context of 256 with distinct mscales
PHIMOE_PRESET = ("phimoe", "PhimoeForCausalLM",
                 {"intermediate_size": 48, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                  "attention_bias": True, "lm_head_bias": True, "router_jitter_noise": 0.1,
                  "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                      "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                      "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.0, 9.0],
                                      "short_mscale": 1.2, "long_mscale": 1.35, "original_max_position_embeddings": 256}})
# DBRX: bias-free LayerNorms, one Wqkv clamped to 0.8 over 2 KV heads, top-2 of 4 experts (E * I rows per tensor)
# divided by their 1-norm; the RoPE base given twice alike (transformers 5.25 rotates by the top-level one, flashllm
# by attn_config's, which the published checkpoints set)
DBRX_PRESET = ("dbrx", "DbrxForCausalLM",
               {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512,  # DbrxConfig's own names
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.8, "rope_theta": 500000.0},
                "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}})
# Qwen3-Next: Gated DeltaNet layers (2 key heads of 16, each serving 2 value heads of 24, convolution 4 wide) with
# gated full attention at layer 1 (RoPE over half of each head); top-2 of 8 renormalized beside a gated shared
# expert, layer 2 dense (mlp_only_layers)
QWEN3_NEXT_PRESET = ("qwen3_next", "Qwen3NextForCausalLM",
                     {"intermediate_size": 96, "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64, "mlp_only_layers": [2],
                      "head_dim": 16, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                      "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                      "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4})
# LFM2-MoE: LFM2's short-convolution layers (width 3) around one attention layer; layer 0 dense, then top-3 of 8
# sigmoid-scored experts chosen with a random expert_bias, renormalized and x 1.5
LFM2_MOE_PRESET = ("lfm2_moe", "Lfm2MoeForCausalLM",
                   {"intermediate_size": 96, "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv",
                                                                                     "conv"],
                    "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
                    "routed_scaling_factor": 1.5})
# presets kept apart from MOE_PRESETS, whose models test_moe.py checks for a fused decode step
OTHER_MOE_PRESETS = {"ernie4_5_moe": ERNIE_MOE_PRESET, "granitemoe": GRANITE_MOE_PRESET, "gpt_oss": GPT_OSS_PRESET,
                     "olmoe": OLMOE_PRESET, "flex_olmo": FLEX_OLMO_PRESET, "granitemoeshared": GRANITE_MOE_SHARED_PRESET,
                     "phimoe": PHIMOE_PRESET, "dbrx": DBRX_PRESET, "lfm2_moe": LFM2_MOE_PRESET, "qwen3_next": QWEN3_NEXT_PRESET}
# parameters drawn at unit scale: gpt-oss's sink logits (at INIT_STD they would barely take any attention)
UNIT_SCALE_SUFFIXES = ("self_attn.sinks",)


def build_moe_model(out_dir: Path, preset: str, seed: int = 0, original_format: bool = True,
                    **overrides: object) -> Path:
    """Save a tiny random transformers MoE model; original_format=False keeps transformers 5's stacked experts;
    overrides replace config fields of the preset (vocab_size=512 for a trained tokenizer, say)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, architecture, fields = {**MOE_PRESETS, **OTHER_MOE_PRESETS}[preset]
    config = AutoConfig.for_model(model_type, architectures=[architecture], **{**MOE_BASE, **fields, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen) * INIT_STD
            # a norm's own scale (not every parameter under DBRX's norm_attn_norm block)
            param.copy_(noise + 1.0 if "norm" in name.split(".")[-2] else noise / INIT_STD if name.endswith(UNIT_SCALE_SUFFIXES)
                        else noise)
        for name, tensor in sorted([*model.named_buffers(), *model.named_parameters()]):
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # chooses experts (zeros: untested)
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * INIT_STD * (0.3 if "moe_statics" in name else 1))
    model.save_pretrained(out_dir, save_original_format=original_format)
    return out_dir


def build_glm4_moe_mtp_model(out_dir: Path, seed: int = 0, predictable: float | None = None) -> Path:
    """The glm4_moe preset laid out as GLM-4.5 ships its multi-token-prediction layer: model.layers.{N} a full
    (MoE) decoder block plus enorm, hnorm, eh_proj, shared_head and embed_tokens (testing.deepseek.with_mtp_layer,
    which says what `predictable` does)."""
    from flashllm.testing.deepseek import with_mtp_layer

    layers = MOE_PRESETS["glm4_moe"][2]["num_hidden_layers"]
    build_moe_model(out_dir, "glm4_moe", seed, num_hidden_layers=layers + 1)
    return with_mtp_layer(out_dir, layers, seed, predictable, std=INIT_STD)


def moe_reference(out_dir: Path, preset: str, seed: int) -> tuple[Any, Path]:
    """(transformers' own model of the tiny MoE checkpoint build_moe_model writes to out_dir, fp32 and in eval
    mode; that directory): the reference a family's parity tests compare against."""
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(out_dir, preset, seed=seed)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), model_dir


def check_paged_parity(reference: tuple[Any, Path], ops: Any, registry: Any, paged_driver: Any, vocab: int,
                       lengths: tuple[int, ...] | None, atol: float) -> None:
    """flashllm's model of reference's directory (fp32, CPU) over the paged cache against transformers': varlen
    prefill of prompts of `lengths` then decode (check_varlen_prefill_and_decode), or with lengths None a chunked
    prefill beside a decode (check_chunked_prefill_beside_a_decode)."""
    from flashllm.models.loader import load_model
    from flashllm.testing.parity import (
        check_chunked_prefill_beside_a_decode,
        check_varlen_prefill_and_decode,
        random_tokens,
    )

    hf_model, model_dir = reference
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", registry, progress=False)
    if lengths is None:
        check_chunked_prefill_beside_a_decode(paged_driver(ours, block_size=16, num_blocks=32, seed=5), hf_model,
                                              vocab, atol)
    else:
        check_varlen_prefill_and_decode(paged_driver(ours, block_size=16, num_blocks=64, seed=3), hf_model,
                                        [random_tokens(n, vocab, seed=100 + n) for n in lengths], atol)
