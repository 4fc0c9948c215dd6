"""Random-weight Hugging Face model directories built locally: tiny for tests, full shapes for benchmarks."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Tiny sizes: big enough for GQA (4 query heads over 2 kv heads), several KV blocks per sequence
# and a position range past the llama3 preset's original context.
TINY_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}

# token ids inside the tiny vocabulary, for configs whose defaults lie past it (Phi-3, SmolLM3, OLMo 2)
_PHI3_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3": ("LlamaForCausalLM", {
        "rope_theta": 500000.0,
        # original context 64 with head_dim 16 puts rope frequencies in all three llama3 bands
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # per-head q / k norms; head_dim 32 set explicitly (64 / 4 heads would give 16), as Qwen3's 128 is
    "qwen3": ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 32}),
    # sliding (window 8) and full layers alternating, each with its own RoPE (full: linearly scaled, as in
    # Gemma 3 4B and up); a score scale query_pre_attn_scalar ** -0.5 that head_dim ** -0.5 is not
    "gemma3": ("Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }),
    # Gemma 1: Llama's pre-norm block with Gemma's (1 + w) norms, GeGLU, scaled embedding; head_dim 32 explicit
    # (Gemma's is 256, not hidden / heads); the legacy hidden_act "gelu" the official configs carry
    "gemma": ("GemmaForCausalLM", {"head_dim": 32, "hidden_act": "gelu"}),
    # Gemma 2: Gemma 3's block without q / k norms, even layers sliding (window 8), one RoPE; attention scores and
    # logits capped low enough that the caps change them (the published 50 and 30 barely touch a tiny model's)
    "gemma2": ("Gemma2ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0, "rope_theta": 10000.0,
    }),
    # SmolLM3: layer 3 of 4 without RoPE (transformers' default interval 4), tied embeddings
    "smollm3": ("SmolLM3ForCausalLM", {"tie_word_embeddings": True, "num_hidden_layers": 4, **_PHI3_IDS}),
    # Seed-OSS: biased q / k / v, an unbiased o; head_dim explicit (Seed-OSS's default is 128, not hidden / heads)
    "seed_oss": ("SeedOssForCausalLM", {"head_dim": 16, "attention_bias": True, "attention_out_bias": False,
                                        **_PHI3_IDS}),
    # Hunyuan dense: per-head q / k norms after RoPE, a fixed NTK alpha stretching the RoPE base (as the checkpoints
    # write it: a "dynamic" type with alpha), tied embeddings
    "hunyuan": ("HunYuanDenseV1ForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0,
                                                                  "rope_theta": 10000.0},
                                              "head_dim": 16, "tie_word_embeddings": True, **_PHI3_IDS}),
    # Hunyuan MoE (A13B's shape): the dense Hunyuan's attention, biased on all four projections; top-2 of 4 softmax
    # experts renormalized beside an ungated shared MLP, all intermediate_size (48) wide; per-layer lists as A13B's
    "hunyuan_moe": ("HunYuanMoEV1ForCausalLM", {
        "rope_parameters": {"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0, "rope_theta": 10000.0},
        "head_dim": 16, "intermediate_size": 48, "num_experts": 4, "moe_topk": [2, 2], "attention_bias": True,
        **_PHI3_IDS}),
    # dots.llm1: Qwen3's per-head q / k norms (head_dim 24 explicit) over DeepSeek-V3's routing: sigmoid scores,
    # top-3 of 8 within the best of 2 groups, renormalized and x 1.5, one shared expert; layer 0 dense
    # (first_k_dense_replace), layer 1 sliding (window 8)
    "dots1": ("Dots1ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 24, "moe_intermediate_size": 48, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"], **_PHI3_IDS}),
    # MiniMax-M2: whole-projection q / k norms, RoPE over 8 of 16 features (the legacy rotary_dim); top-3 of 8
    # sigmoid-scored experts (48 wide) chosen with the correction bias and renormalized, every layer sparse
    "minimax_m2": ("MiniMaxM2ForCausalLM", {
        "head_dim": 16, "rotary_dim": 8, "intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 3,
        **_PHI3_IDS}),
    # EXAONE MoE: per-head q / k norms; layers 0-2 sliding (window 8, RoPE), layer 3 global without RoPE
    # (sliding_window_pattern 4); layer 0 dense (first_k_dense_replace), then top-3 of 8 sigmoid-scored experts
    # (48 wide) within the best of 2 groups, renormalized and x 1.5, beside one shared expert
    "exaone_moe": ("ExaoneMoeForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 48,
        "num_experts": 8, "num_experts_per_tok": 3, "num_shared_experts": 1, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 1.5, "sliding_window": 8, "sliding_window_pattern": 4, **_PHI3_IDS}),
    # AFMoE (Arcee Trinity): layers 0 and 2 sliding (window 8) with RoPE, 1 and 3 full without; gated attention
    # output, per-head q / k norms, sandwich norms, muP-scaled embeddings; layer 0 dense, then top-3 of 8
    # sigmoid-scored experts chosen with expert_bias, renormalized and x 2.5, beside two shared experts
    "afmoe": ("AfmoeForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 3, "num_shared_experts": 2, "num_dense_layers": 1,
        "route_scale": 2.5, "global_attn_every_n_layers": 2, "sliding_window": 8, "mup_enabled": True,
        **_PHI3_IDS}),
    # Solar Open: biased q / k / v (o unbiased), no q / k norms; every layer sparse: GLM-4.5's routing (sigmoid, the
    # correction bias, top-3 of 8 within the best 2 of 4 groups, renormalized and x 2.0) beside two shared experts
    "solar_open": ("SolarOpenForCausalLM", {
        "head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 3,
        "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0, "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **_PHI3_IDS}),
    # Llama 4: layer 3 NoPE (interval 4) with a query temperature that steps every 16 positions (x 0.5), the RoPE
    # layers (adjacent pairs, llama3-scaled past 64) L2-normed after RoPE; layers 1 and 3 MoE (step 2): top-1 of 4
    # sigmoid-scored experts (48 wide, unequal to hidden so the fused layout shows) and a shared one, dense 96 wide;
    # 64-token chunks on the RoPE layers, so the tests' longer prompts cross chunk boundaries
    "llama4": ("Llama4ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 48, "intermediate_size_mlp": 96,
        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "attention_chunk_size": 64,
        "floor_scale": 16, "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **_PHI3_IDS}),
    # StarCoder 2: biased LayerNorms, an ungated tanh-GELU MLP and biases on every projection (use_bias), tied
    # embeddings, a sliding window (8) on every layer shorter than most test prompts
    "starcoder2": ("Starcoder2ForCausalLM", {"sliding_window": 8, "norm_epsilon": 1e-5, **_PHI3_IDS}),
    # Arcee: Llama's decoder with an ungated relu² MLP (no gate_proj), YaRN past an original context of 64
    "arcee": ("ArceeForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                       "original_max_position_embeddings": 64}, **_PHI3_IDS}),
    # Nemotron: 1 + w LayerNorms with biases, an ungated relu² MLP, RoPE over the first half of each head (its
    # default partial_rotary_factor); untied
    "nemotron": ("NemotronForCausalLM", {"norm_eps": 1e-5}),
    # StableLM 2: biased LayerNorms, q / k / v biases (use_qkv_bias), RoPE over a quarter of each head (4 of 16
    # features, its default); untied. use_parallel_residual and qk_layernorm (StableLM 2 12B) are overrides
    "stablelm": ("StableLmForCausalLM", {"use_qkv_bias": True, "layer_norm_eps": 1e-5, **_PHI3_IDS}),
    # OLMo (first generation): LayerNorms without scale or shift, q / k / v clamped at 0.5 (OLMo-7B-0424's
    # clip_qkv of 8 never binds in a tiny model; 0.5 clips part of the projections), untied
    "olmo": ("OlmoForCausalLM", {"clip_qkv": 0.5, **_PHI3_IDS}),
    # Helium: RoPE over adjacent feature pairs, biased q / k / v (attention_bias) under an unbiased o_proj, MLP
    # biases; head_dim 16 explicit (HeliumConfig's default is 128), 4 x 16 = hidden_size as its o_proj needs
    "helium": ("HeliumForCausalLM", {"head_dim": 16, "attention_bias": True, "mlp_bias": True, **_PHI3_IDS}),
    # Apertus: per-head q / k RMSNorms, the ungated xIELU MLP (its alpha_p / alpha_n redrawn per layer), llama3
    # RoPE over an original context of 64 so head_dim 16's frequencies fall in all three bands, as the llama3 preset
    "apertus": ("ApertusForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    # OLMo 2: norms after each branch, q / k RMS-normed over all heads together (untied, as OLMo-2-7B)
    "olmo2": ("Olmo2ForCausalLM", {**_PHI3_IDS}),
    # OLMo 3: three sliding layers (window 8) then a full one whose RoPE is linearly scaled, the sliding ones' not
    "olmo3": ("Olmo3ForCausalLM", {"num_hidden_layers": 4, "sliding_window": 8, "rope_theta": 10000.0,
                                   "rope_scaling": {"rope_type": "linear", "factor": 4.0}, **_PHI3_IDS}),
    # EXAONE 4.0's hybrid attention, pattern 4 ("LLLG": three sliding layers of window 8, then a global one
    # without RoPE), per-head q / k norms, norms after each branch
    "exaone4": ("Exaone4ForCausalLM", {"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4,
                                       **_PHI3_IDS}),
    # Command R: the parallel block of bias-free LayerNorms (eps 1e-5 where TINY_BASE's rms_norm_eps is moot),
    # adjacent-pair RoPE (base 10000, not the default 500000 that barely turns at 512 positions), logits x 0.25,
    # tied embeddings (CohereConfig's default); use_qk_norm (Command R+) is a build_tiny_model override
    "cohere": ("CohereForCausalLM", {"logit_scale": 0.25, "layer_norm_eps": 1e-5, "rope_theta": 10000.0, **_PHI3_IDS}),
    # Command R7B's hybrid attention, pattern 2: sliding layers (window 8) with RoPE alternating with full layers
    # without any positional embedding; logits x 0.25
    "cohere2": ("Cohere2ForCausalLM", {"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 2,
                                       "logit_scale": 0.25, **_PHI3_IDS}),
    # Phi (phi-2's shape): the parallel block (one LayerNorm feeding attention and MLP), biases on every projection
    # and on the LM head, RoPE over int(16 x 0.4) = 6 features of each head, as phi-2's 0.4 of 80; untied
    "phi": ("PhiForCausalLM", {"partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5}),
    # GPT-J: Phi's parallel block (one LayerNorm, ln_1) without attention biases, RoPE turning adjacent pairs of the
    # first rotary_dim = 6 of each head's 16 features, n_inner unset (4 x n_embd = 256: GPTJConfig ignores TINY_BASE's
    # intermediate_size and num_key_value_heads), a biased untied lm_head; token ids inside the tiny vocabulary
    "gptj": ("GPTJForCausalLM", {"rotary_dim": 6, "layer_norm_epsilon": 1e-5, **_PHI3_IDS}),
    # CodeGen: GPT-J with one qkv_proj laid out for 4 shards of [q | v | k]; 8 heads of 8 so that each shard holds
    # two heads (with 4 heads the shards would be the heads), RoPE over 4 of each head's 8 features
    "codegen": ("CodeGenForCausalLM", {"num_attention_heads": 8, "rotary_dim": 4, "layer_norm_epsilon": 1e-5,
                                       **_PHI3_IDS}),
    # GPT-NeoX (Pythia): the parallel residual with two LayerNorms of the same input, q / k / v fused per head in one
    # biased query_key_value, RoPE over a quarter of each head (4 of 16 features, rotary_pct's default); as many key /
    # value heads as query heads (TINY_BASE's 2 would be GQA, which GPT-NeoX has not); untied embed_out
    "gpt_neox": ("GPTNeoXForCausalLM", {"num_key_value_heads": 4, "layer_norm_eps": 1e-5, "rotary_pct": 0.25}),
    # GPTBigCode (StarCoder 1): multi-query attention (one key / value head, transformers' default) fused with the
    # queries in one biased c_attn, learned absolute positions (wpe) and no RoPE, biased LayerNorms and a biased
    # n_inner-wide tanh-GELU MLP (GPTBigCodeConfig ignores TINY_BASE's intermediate_size), a head tied to wte; token
    # ids inside the tiny vocabulary (the defaults are GPT-2's 50256)
    "gpt_bigcode": ("GPTBigCodeForCausalLM", {"n_inner": 96, **_PHI3_IDS}),
    # GPT-2: GPTBigCode's block with multi-head attention, its projections stored as transposed Conv1D weights and
    # c_attn's rows [q | k | v]; gelu_new, the 4 x n_embd MLP (GPT2Config ignores TINY_BASE's intermediate_size)
    "gpt2": ("GPT2LMHeadModel", {**_PHI3_IDS}),
    # OPT (opt-125m's pre-norm block): learned positions read at position + 2, separate biased q / k / v / out_proj,
    # a biased ffn_dim-wide ReLU MLP (OPTConfig ignores TINY_BASE's intermediate_size), a head tied to the embeddings
    "opt": ("OPTForCausalLM", {"ffn_dim": 96}),
    # GPT-Neo: GPT-2's block with separate unbiased q / k / v and unscaled scores; a global then a local layer
    # (window 8, shorter than most test prompts), gelu_new, TINY_BASE's intermediate_size, a head tied to wte
    "gpt_neo": ("GPTNeoForCausalLM", {"attention_types": [[["global", "local"], 1]], "window_size": 8, **_PHI3_IDS}),
    # XGLM: OPT's pre-norm block with sinusoidal positions (offset 2) and embeddings x sqrt(d_model); ffn_dim wide GELU
    "xglm": ("XGLMForCausalLM", {"ffn_dim": 96}),
    # BLOOM: ALiBi over 6 heads (not a power of two: 4 geometric slopes, then 2 from the 8-head sequence), the normed
    # embedding, q / k / v fused per head in one biased query_key_value, a 4 x hidden tanh-GELU MLP, tied embeddings;
    # BloomConfig ignores TINY_BASE's intermediate_size / num_key_value_heads / max_position_embeddings
    "bloom": ("BloomForCausalLM", {"hidden_size": 96, "num_attention_heads": 6, "layer_norm_epsilon": 1e-5}),
    # MPT: ALiBi over 6 heads (MPT's own slope order, odd ones of 8 first), no biases anywhere (LayerNorms included),
    # q | k | v fused whole in Wqkv, an exact-GELU 4 x d_model MLP, tied embeddings; softmax_scale and clip_qkv are
    # build_tiny_model overrides (attn_config)
    "mpt": ("MptForCausalLM", {"hidden_size": 96, "num_attention_heads": 6, "layer_norm_epsilon": 1e-5}),
    # Falcon-40B / 180B's new_decoder_architecture: query_key_value fused per key / value group ([2 q | k | v] for
    # each of 2 groups), ln_attn and ln_mlp feeding a parallel attention + MLP, no biases, a 4 x hidden GELU MLP, tied
    # embeddings; FalconConfig ignores TINY_BASE's intermediate_size / num_key_value_heads / rms_norm_eps
    "falcon": ("FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2, "layer_norm_epsilon": 1e-5}),
    # fused qkv_proj / gate_up_proj tensors; a sliding window shorter than most test prompts (Phi-3-mini-4k's
    # is 2047); token ids inside the tiny vocabulary (Phi3Config's defaults are Phi-3's 32000)
    "phi3": ("Phi3ForCausalLM", {"sliding_window": 48, **_PHI3_IDS}),
    # Phi-4-mini's shape: LongRoPE past an original context of 64 (short and long factors far apart) and
    # RoPE on the first 0.75 of each head (12 of 16 features: 6 factors a set)
    "phi3-longrope": ("Phi3ForCausalLM", {
        "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]},
        **_PHI3_IDS,
    }),
    # Persimmon: q / k / v fused per head with biases, biased LayerNorms on every query and key head, RoPE over half
    # of each head (base 25000, persimmon-8b's), a biased relu2 MLP; PersimmonConfig ignores num_key_value_heads
    "persimmon": ("PersimmonForCausalLM", {"rope_theta": 25000.0, "intermediate_size": 96}),
    # LFM2: short-convolution layers (width 3, biased here; the published ones are not) around one attention layer with
    # q / k norms; the feed-forward's width derived as Lfm2MLP does (2/3 of 128, rounded up to 32: 96); tied embeddings
    "lfm2": ("Lfm2ForCausalLM", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "conv"],
                                 "block_multiple_of": 32, "conv_bias": True, **_PHI3_IDS}),
    # Mamba-2: 8 heads of 16 over 2 groups of B / C (d_state 16), a width-4 conv, prefill blocks of 16 tokens so
    # longer prompts cross blocks; no attention layer, every layer keeps a conv and an SSM state per sequence
    "mamba2": ("Mamba2ForCausalLM", {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16,
                                     "chunk_size": 16, "expand": 2, "bos_token_id": 1, "eos_token_id": 2}),
    # Bamba: Mamba-2 layers 0 and 2 (8 heads of 16, 2 groups, d_state 16, blocks of 16) around attention layer 1
    # (4 query heads over 2 KV heads, RoPE over half of each head)
    "bamba": ("BambaForCausalLM", {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 8,
                                   "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16}),
    # Granite 4.0-H: Mamba-2 layers 0 and 2 around a NoPE attention layer 1, top-2 of 4 experts 32 wide beside a
    # shared MLP 48 wide in every layer, Granite's four multipliers far from 1 (as the granite preset's)
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", {
        "num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8,
        "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
        "position_embedding_type": "nope", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625, "logits_scaling": 8.0}),
    # Nemotron-H: one mixer per layer, Mamba-2 (8 heads of 16, 2 groups, d_state 16, blocks of 16), NoPE attention
    # (4 query heads of 16 over 2 KV heads) and relu2 MLPs, in the pattern M-*M-
    "nemotron_h": ("NemotronHForCausalLM", {
        "hybrid_override_pattern": "M-*M-", "num_hidden_layers": 5, "head_dim": 16, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16}),
    # Ministral: a window of 8 on layers 0 and 2 only (layer_types), full attention on layer 1; head_dim explicit
    # (transformers' Ministral cannot run without one) and not hidden / heads
    "ministral": ("MinistralForCausalLM", {
        "num_hidden_layers": 3, "sliding_window": 8, "head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    }),
    # every multiplier far from 1 and from what Llama would use: embeddings x 12, branch outputs x 0.22, a score
    # scale 1 / head_dim (Granite's 1 / 128 at head_dim 16) where Llama's would be 0.25, logits / 8
    "granite": ("GraniteForCausalLM", {
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
        "logits_scaling": 8.0,
    }),
    # ERNIE 4.5: RoPE over adjacent feature pairs, a bias on every projection (use_bias), tied embeddings;
    # head_dim explicit (ERNIE's default is 128, not hidden / heads)
    "ernie4_5": ("Ernie4_5ForCausalLM", {"use_bias": True, "head_dim": 16, "tie_word_embeddings": True,
                                         "rope_theta": 10000.0}),
    # MiniCPM3: DeepSeek's MLA (q through a rank-32 bottleneck, a 16 + 8 latent, half-split RoPE) with MiniCPM's
    # scalings far from 1: embeddings x 12, branches x 1.4 / sqrt(2), hidden / (64 / 16) before the tied head
    "minicpm3": ("MiniCPM3ForCausalLM", {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                         "dim_model_base": 16, "rope_theta": 10000.0}),
    # CWM: layer_types by its default pattern (full, then sliding, sliding; window 8), llama3 RoPE over an original
    # context of 64 (as the apertus preset), head_dim explicit (CwmConfig's default is 128)
    "cwm": ("CwmForCausalLM", {"num_hidden_layers": 3, "sliding_window": 8, "head_dim": 16, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    # Mamba: 2 blocks of the selective-scan mixer (128 channels, d_state 8, conv width 4, dt rank auto = 4), no
    # attention; FalconMamba: the same with RMS-normed dt / B / C, biased in_proj / out_proj, an unbiased conv
    "mamba": ("MambaForCausalLM", {"state_size": 8}),
    "falcon_mamba": ("FalconMambaForCausalLM", {"state_size": 8, "use_bias": True, "use_conv_bias": False,
                                                "time_step_rank": 6, "mixer_rms_eps": 1e-5}),
    # Jamba: layer 1 attention (period 3, offset 1), layers 0, 2 and 3 Mamba (128 channels, d_state 8, dt rank 4,
    # learned dt / B / C norms); layers 1 and 3 MoE (period 2, offset 1: top-2 of 4 experts 96 wide, not
    # renormalized), 0 and 2 dense; so attention + MoE, Mamba + MoE and Mamba + dense blocks all occur
    "jamba": ("JambaForCausalLM", {"num_hidden_layers": 4, "intermediate_size": 96, "attn_layer_period": 3,
                                   "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
                                   "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
                                   "max_position_embeddings": 512, **_PHI3_IDS}),
}
# transformers' model_type of each preset's architecture
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "Gemma3ForCausalLM": "gemma3_text", "Gemma2ForCausalLM": "gemma2", "GemmaForCausalLM": "gemma",
                "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3", "OlmoForCausalLM": "olmo", "HeliumForCausalLM": "helium", "ApertusForCausalLM": "apertus",
                "Olmo2ForCausalLM": "olmo2",
                "Olmo3ForCausalLM": "olmo3", "Exaone4ForCausalLM": "exaone4", "SeedOssForCausalLM": "seed_oss",
                "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",
                "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe", "Dots1ForCausalLM": "dots1", "AfmoeForCausalLM": "afmoe", "SolarOpenForCausalLM": "solar_open", "MiniMaxM2ForCausalLM": "minimax_m2", "ExaoneMoeForCausalLM": "exaone_moe", "Llama4ForCausalLM": "llama4_text", "GraniteForCausalLM": "granite",
                "MinistralForCausalLM": "ministral", "PersimmonForCausalLM": "persimmon", "Lfm2ForCausalLM": "lfm2", "Mamba2ForCausalLM": "mamba2", "BambaForCausalLM": "bamba",
                "GraniteMoeHybridForCausalLM": "granitemoehybrid", "NemotronHForCausalLM": "nemotron_h",
                "Ernie4_5ForCausalLM": "ernie4_5", "MiniCPM3ForCausalLM": "minicpm3", "CwmForCausalLM": "cwm",
                "Starcoder2ForCausalLM": "starcoder2", "ArceeForCausalLM": "arcee",
                "GPTJForCausalLM": "gptj", "CodeGenForCausalLM": "codegen",
                "PhiForCausalLM": "phi", "GPTNeoXForCausalLM": "gpt_neox",
                "GPTBigCodeForCausalLM": "gpt_bigcode", "GPT2LMHeadModel": "gpt2", "OPTForCausalLM": "opt", "GPTNeoForCausalLM": "gpt_neo", "XGLMForCausalLM": "xglm", "BloomForCausalLM": "bloom", "MptForCausalLM": "mpt",
                "FalconForCausalLM": "falcon",
                "CohereForCausalLM": "cohere", "Cohere2ForCausalLM": "cohere2",
                "NemotronForCausalLM": "nemotron", "StableLmForCausalLM": "stablelm",
                "MambaForCausalLM": "mamba", "FalconMambaForCausalLM": "falcon_mamba", "JambaForCausalLM": "jamba"}

# A weight scale large enough that attention is far from uniform (scores of order 1) and logits
# are of order 1, so parity tests notice position or masking mistakes.
TINY_INIT_STD = 0.1
TINY_TOKENIZER_VOCAB = 512
DEFAULT_VOCAB_WITHOUT_TOKENIZER = 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(
    out_dir: str | Path, arch: str = "llama", *, seed: int = 0, tokenizer: bool = True,
    dtype: torch.dtype = torch.float32, max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight transformers model (config, safetensors, tokenizer) to out_dir.

    arch: a preset of PRESETS ("llama" GQA, "llama3" llama3 rope scaling, "llama-tied" tied
    embeddings, "qwen2" qkv bias + tied, "qwen3" per-head q / k norms + tied, "gemma2" Gemma 2's capped scores and
    logits, "gemma3" Gemma 3's
    sliding and full layers + tied, "phi3" fused projections + sliding window, "phi3-longrope" LongRoPE +
    partial rotary, "granite" Granite's four multipliers). Weights are drawn from `seed` (same seed, same
    files); every parameter, biases and norm scales included, is random so none of them can be ignored.
    tokenizer: also train and save a small tokenizer with a chatml template; the model's vocab
    is then the tokenizer's. max_shard_size (e.g. "20KB") writes a sharded checkpoint.
    config_overrides replace any config field. Returns out_dir.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in PRESETS:
        raise ValueError(f"unknown tiny model preset {arch!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    architecture, preset = PRESETS[arch]
    # a deep copy: transformers' configs complete a rope_scaling dict in place, which would change PRESETS
    fields: dict[str, Any] = copy.deepcopy({**TINY_BASE, **preset, "vocab_size": DEFAULT_VOCAB_WITHOUT_TOKENIZER})
    if tokenizer:
        fields.update(_train_tokenizer(out_dir))
    fields.update(config_overrides)
    model_type = _MODEL_TYPES[architecture]
    config = AutoConfig.for_model(model_type, architectures=[architecture], **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    _randomize_(model, seed)
    model.to(dtype)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def _train_tokenizer(out_dir: Path) -> dict[str, Any]:
    from flashllm.testing.tokenizer import train_tokenizer

    tok = train_tokenizer(out_dir, vocab_size=TINY_TOKENIZER_VOCAB, chat_template=CHATML_TEMPLATE)
    fields: dict[str, Any] = {"vocab_size": len(tok)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tok, key, None) is not None:
            fields[key] = getattr(tok, key)
    return fields


@torch.no_grad()
def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: norm scales around 1, everything else N(0, TINY_INIT_STD)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * TINY_INIT_STD
        if "norm" in name or ".ln_" in name:  # GPT-2-style LayerNorm names too (ln_1, ln_f)
            noise += 1.0
        param.copy_(noise)


def build_random_model_from_config(
    out_dir: str | Path, hf_config_dict: dict[str, Any], seed: int = 0,
    max_shard_bytes: int = 1 << 30,
) -> Path:
    """Write config.json and N(0, 0.02) weights (norm scales 1) for any Llama/Qwen2-shaped config (MoE too).

    No transformers model is built: tensors are drawn one at a time from a seeded generator and
    written shard by shard (at most ~max_shard_bytes each, plus an index when there are several),
    so a 0.5B shape needs about one shard of memory. The dtype is the config's "dtype" /
    "torch_dtype" (float32 or bfloat16; float32 when absent). Returns out_dir.
    """
    from flashllm.models.hf_config import parse_hf_config

    config = parse_hf_config(hf_config_dict, source="hf_config_dict")  # the built-in architectures
    dtype = config.torch_dtype or torch.float32
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict, indent=2) + "\n")
    generation = {k: hf_config_dict[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config_dict}
    if generation:
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    writer = _ShardWriter(out_dir, max_shard_bytes)
    for name, shape, is_norm in _hf_tensor_shapes(config):
        tensor = torch.ones(shape) if is_norm else torch.randn(shape, generator=gen) * 0.02
        writer.add(name, tensor.to(dtype))
    writer.close()
    return out_dir


class _ShardWriter:
    """Accumulates tensors and writes a safetensors shard whenever the next one would overflow."""

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.current and self.current_bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        self.current[name] = tensor
        self.current_bytes += tensor.nbytes

    def _flush(self) -> None:
        file_name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.current, self.out_dir / file_name, metadata={"format": "pt"})
        self.files.append(file_name)
        self.weight_map.update(dict.fromkeys(self.current, file_name))
        self.current, self.current_bytes = {}, 0

    def close(self) -> None:
        """Write the last shard, then either rename a lone shard or write the index."""
        self._flush()
        if len(self.files) == 1:
            (self.out_dir / self.files[0]).rename(self.out_dir / "model.safetensors")
            return
        index = {"metadata": {}, "weight_map": self.weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _hf_tensor_shapes(config: Any) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(HF tensor name, shape, is a norm scale) of every tensor of a Llama/Qwen2 checkpoint."""
    from flashllm.models.builtin import BUILTIN_MODELS
    from flashllm.models.registry import ModelRegistry

    if hasattr(config, "kv_lora_rank"):  # multi-head latent attention: DeepSeek's own tensor names
        from flashllm.testing.deepseek import deepseek_tensor_shapes

        yield from deepseek_tensor_shapes(config)
        return
    registry = ModelRegistry()
    for arch, target in BUILTIN_MODELS.items():
        registry.register(arch, target)
    qkv_bias, o_bias = registry.resolve(config.architecture).attention_biases(config)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    yield "model.embed_tokens.weight", (config.vocab_size, h), False
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), True
        yield f"{p}.post_attention_layernorm.weight", (h,), True
        for proj, out_features in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{p}.self_attn.{proj}.weight", (out_features, h), False
            if qkv_bias:
                yield f"{p}.self_attn.{proj}.bias", (out_features,), False
        if getattr(config, "qk_norm", False):  # Qwen3's per-head norms
            yield f"{p}.self_attn.q_norm.weight", (d,), True
            yield f"{p}.self_attn.k_norm.weight", (d,), True
        yield f"{p}.self_attn.o_proj.weight", (h, q), False
        if o_bias:
            yield f"{p}.self_attn.o_proj.bias", (h,), False
        if getattr(config, "sparse_layers", ()) and config.sparse_layers[i]:  # a MoE layer (models/mixtral.py)
            yield from _moe_tensor_shapes(f"{p}.mlp", config)
            continue
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            yield f"{p}.mlp.{proj}.weight", shape, False
            if config.mlp_bias:
                yield f"{p}.mlp.{proj}.bias", (shape[0],), False
    yield "model.norm.weight", (h,), True
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h), False


def _moe_tensor_shapes(prefix: str, config: Any) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(HF tensor name, shape, False) of one MoE MLP in Qwen2-MoE's names: router, experts, shared expert."""
    h, inter, shared = config.hidden_size, config.moe_intermediate_size, config.shared_expert_intermediate_size
    yield f"{prefix}.gate.weight", (config.num_experts, h), False
    for e in range(config.num_experts):
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            yield f"{prefix}.experts.{e}.{proj}.weight", shape, False
    if shared:
        for proj, shape in (("gate_proj", (shared, h)), ("up_proj", (shared, h)), ("down_proj", (h, shared))):
            yield f"{prefix}.shared_expert.{proj}.weight", shape, False
        yield f"{prefix}.shared_expert_gate.weight", (1, h), False
