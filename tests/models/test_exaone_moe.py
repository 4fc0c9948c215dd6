"""EXAONE MoE (ExaoneMoeForCausalLM): config.json read as transformers' ExaoneMoeConfig reads it (its defaults,
sliding layers from sliding_window_pattern or layer_types, dense layers from first_k_dense_replace or
mlp_layer_types), a random e_score_correction_bias and the variants (no groups, weights not renormalized, no
sliding layers, transformers 5's stacked experts, next-token-prediction tensors skipped) against transformers, and
two tensor-parallel and two expert-parallel ranks. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.testing.correction_bias import redraw_correction_bias
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["ExaoneMoeForCausalLM"], "model_type": "exaone_moe", "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
# K-EXAONE's routing fields (sizes scaled down)
K_EXAONE = {"num_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "sliding_window": 128, "sliding_window_pattern": 4, "rope_theta": 1000000.0,
            "head_dim": 32, "max_position_embeddings": 262144, "tie_word_embeddings": False}


@pytest.mark.parametrize("changes", [
    {}, K_EXAONE,
    {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "num_shared_experts": 2, "first_k_dense_replace": 2,
     "sliding_window_pattern": 2, "norm_topk_prob": False, "tie_word_embeddings": True},
    {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "layer_types": ["full_attention"] * 4},
    {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 16},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import ExaoneMoeConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), ExaoneMoeConfig(**{**RAW, **changes})
    for field in ("num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
                  "norm_topk_prob", "routed_scaling_factor", "num_key_value_heads", "rms_norm_eps",
                  "tie_word_embeddings", "max_position_embeddings", "hidden_act", "intermediate_size", "vocab_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.num_experts == theirs.num_experts and ours.n_shared_experts == theirs.num_shared_experts
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    windows = tuple(theirs.sliding_window if kind == "sliding_attention" else None for kind in theirs.layer_types)
    assert ours.sliding_windows == windows
    assert ours.rope_layers == tuple(theirs.sliding_window is None or w is not None for w in windows)
    assert ours.sparse_layers == tuple(kind == "sparse" for kind in theirs.mlp_layer_types)
    assert ours.qk_norm and ours.sigmoid_scoring and ours.choice_bias and ours.group_limited and not ours.qkv_bias
    assert ours.shared_expert_intermediate_size == theirs.num_shared_experts * theirs.moe_intermediate_size


def test_fields_left_out_take_exaone_moe_config_defaults() -> None:
    from transformers import ExaoneMoeConfig

    raw = {"architectures": ["ExaoneMoeForCausalLM"], "model_type": "exaone_moe"}
    ours, theirs = parse_hf_config(raw), ExaoneMoeConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
                  "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor",
                  "norm_topk_prob", "n_group", "topk_group", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_experts, ours.n_shared_experts) == (theirs.num_experts, theirs.num_shared_experts)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.sliding_windows[:4] == (4096, 4096, 4096, None)  # sliding_window_pattern 4
    assert ours.rope_layers[:4] == (True, True, True, False)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ({"n_group": 3}, "n_group=3, topk_group=1 do not fit"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must list 4 entries"),
    ({"layer_types": ["full_attention", "global"] * 2}, "layer_types must list 4 entries"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern=0"),
    ({"sliding_window": None}, "sliding_window is null"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


def _rewrite_checkpoint(model_dir, seed: int, stacked: bool = False) -> None:
    """A random correction bias (redraw_correction_bias) and a next-token-prediction tensor (`mtp.*`, which both
    skip) added."""
    mtp = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
    redraw_correction_bias(model_dir, seed, stacked=stacked, extra={"mtp.layers.0.eh_proj.weight": mtp})


@pytest.mark.parametrize(("changes", "stacked"), [
    ({}, False),
    ({"n_group": 1, "norm_topk_prob": False, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
      "tie_word_embeddings": True}, False),
    ({"layer_types": ["full_attention"] * 4, "num_shared_experts": 2}, True),
], ids=["preset", "ungrouped-unnormalized-tied", "all-global-nope-stacked"])
def test_variants_with_a_correction_bias_match_transformers(changes, stacked, tmp_path) -> None:
    """The preset (NoPE global layer 3, groups of 4), dense layers by mlp_layer_types with ungrouped weights left as
    scored, and every layer global (so none rotates) with two shared experts in transformers 5's stacked layout."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "exaone_moe", seed=5, tokenizer=False, **changes)
    _rewrite_checkpoint(model_dir, seed=7, stacked=stacked)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    layers = llm.engine.parts.model.model.layers
    assert type(layers[0].mlp) is GatedMLP and type(layers[1].mlp) is DeepseekMoE
    assert layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    nope = [type(layer.self_attn.rotary_emb) is NoPositionEmbedding for layer in layers]
    assert nope == ([True] * 4 if "layer_types" in changes else [False, False, False, True])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' and experts' feature slices; expert parallel ranks hold 4 experts."""
    model_dir = build_tiny_model(tmp_path, "exaone_moe", seed=2, tokenizer=False)
    _rewrite_checkpoint(model_dir, seed=3)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir, **options)
