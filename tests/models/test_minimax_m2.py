"""MiniMax-M2 (MiniMaxM2ForCausalLM): config.json read as transformers' MiniMaxM2Config reads it (its defaults, the
legacy rotary_dim), the MiniMax fields that would mean another computation refused, a random e_score_correction_bias
and the variants (full rotary, top-2 with tied embeddings, transformers 5's stacked experts) against transformers,
and two tensor-parallel and two expert-parallel ranks. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.correction_bias import redraw_correction_bias
from flashllm.testing.deepseek import write_block_fp8_copy, write_dequantized_copy
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 64,
       "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "vocab_size": 256, "num_local_experts": 8, "num_experts_per_tok": 3}
# MiniMax-M2's own config.json fields (sizes scaled down; its block-FP8 quantization_config left out)
M2 = {"rotary_dim": 8, "rope_theta": 5000000, "use_qk_norm": True, "qk_norm_type": "per_layer",
      "scoring_func": "sigmoid", "shared_intermediate_size": 0, "use_routing_bias": True, "attn_type_list": [1, 1],
      "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1, "max_position_embeddings": 196608,
      "bos_token_id": 200034, "eos_token_id": 200020, "vocab_size": 200064}


@pytest.mark.parametrize("changes", [
    {}, M2,
    {"partial_rotary_factor": 0.25, "rotary_dim": 8, "tie_word_embeddings": True, "num_experts_per_tok": 8},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
     "sliding_window": 8, "attention_bias": True, "rms_norm_eps": 1e-5},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import MiniMaxM2Config

    ours, theirs = parse_hf_config({**RAW, **changes}), MiniMaxM2Config(**{**RAW, **changes})
    for field in ("num_experts_per_tok", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
                  "max_position_embeddings", "hidden_act", "intermediate_size", "head_dim", "vocab_size",
                  "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.num_experts == ours.n_routed_experts == theirs.num_local_experts
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rotary_dim == int(theirs.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    assert ours.sliding_windows == (None, None) and not ours.qkv_bias  # transformers' MiniMaxM2 reads neither
    assert ours.moe_intermediate_size == theirs.intermediate_size and ours.sparse_layers == (True, True)
    assert ours.sigmoid_scoring and ours.choice_bias and not ours.group_limited and ours.norm_topk_prob
    assert ours.shared_expert_intermediate_size == 0 and ours.routed_scaling_factor == 1.0


def test_fields_left_out_take_minimax_m2_config_defaults() -> None:
    from transformers import MiniMaxM2Config

    raw = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2"}
    ours, theirs = parse_hf_config(raw), MiniMaxM2Config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                  "eos_token_id", "num_experts_per_tok", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_experts, ours.rope_theta, ours.rotary_dim) == (
        theirs.num_local_experts, theirs.rope_parameters["rope_theta"], theirs.head_dim)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_local_experts=8"),
    ({"use_qk_norm": False}, "use_qk_norm=False is not supported"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size=64 is not supported"),
    ({"attn_type_list": [0, 1]}, "asks for linear-attention layers"),
    ({"rotary_dim": 7}, "rotary_dim=7"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "checkpoints load as float or as block FP8"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "checkpoints load as float or as block FP8"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("changes", "stacked"), [
    ({}, False), ({"rotary_dim": 16, "num_experts_per_tok": 2, "tie_word_embeddings": True}, False), ({}, True),
], ids=["preset", "full-rotary-top2-tied", "stacked-experts"])
def test_variants_with_a_correction_bias_match_transformers(changes, stacked, tmp_path) -> None:
    """The preset (RoPE over half of each head, top-3 of 8), full rotary with top-2 and tied embeddings, and the
    preset saved with transformers 5's stacked experts, each with a random correction bias."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "minimax_m2", seed=5, tokenizer=False, **changes)
    redraw_correction_bias(model_dir, seed=7, stacked=stacked)
    names = set(load_file(model_dir / "model.safetensors"))
    assert ("model.layers.1.mlp.e_score_correction_bias" in names) == stacked
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    layers = llm.engine.parts.model.model.layers
    assert type(layers[1].mlp) is DeepseekMoE and layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert layers[0].self_attn.rotary_emb.rotary_dim == changes.get("rotary_dim", 8)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' (the q / k norms gathered over both) and experts' feature slices;
    expert parallel ranks hold 4 experts each."""
    model_dir = build_tiny_model(tmp_path, "minimax_m2", seed=2, tokenizer=False)
    redraw_correction_bias(model_dir, seed=3)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir, **options)


def test_a_block_fp8_checkpoint_runs_as_transformers_runs_its_dequantized_weights(tmp_path) -> None:
    """The published checkpoints' format (e4m3 codes, one weight_scale_inv per block; ragged 16 x 24 blocks here):
    dequantized at load, the engine's tokens and logits are transformers' on code x block scale."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "float", "minimax_m2", seed=5, tokenizer=False)
    redraw_correction_bias(model_dir, seed=7)
    fp8_dir = write_block_fp8_copy(model_dir, tmp_path / "fp8", (16, 24))
    stored = load_file(fp8_dir / "model.safetensors")
    assert stored["model.layers.1.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32  # routers stay float
    llm = LLM(str(fp8_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    assert llm.engine.parts.model.config.fp8_block == (16, 24)
    hf = AutoModelForCausalLM.from_pretrained(write_dequantized_copy(fp8_dir, tmp_path / "dequantized"),
                                              dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)
