"""Solar Open (SolarOpenForCausalLM): config.json read as transformers' SolarOpenConfig reads it (its defaults, the
num_local_experts alias, the GLM-4.5 fields it does not read), refusals, random correction biases and the variants
(one group, weights as scored, no shared expert, unbiased attention, tied embeddings) against transformers, and two
tensor-parallel and two expert-parallel ranks. The tiny preset's paged-forward and engine parity with transformers
run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.correction_bias import redraw_correction_bias
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["SolarOpenForCausalLM"], "model_type": "solar_open", "hidden_size": 64,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
       "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Solar-Open-100B's own routing fields (sizes shrunk), with the GLM-4.5 fields SolarOpenConfig does not read
OPEN_100B = {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "n_group": 1,
             "topk_group": 1, "rope_theta": 1000000, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
             "intermediate_size": 10240, "first_k_dense_replace": 0, "use_qk_norm": False}


@pytest.mark.parametrize("changes", [
    {}, OPEN_100B,
    {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "attention_bias": True, "routed_scaling_factor": 2.5,
     "norm_topk_prob": False, "n_shared_experts": 0, "tie_word_embeddings": True, "first_k_dense_replace": 2},
    {"num_local_experts": 16, "n_routed_experts": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 50000.0}},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import SolarOpenConfig

    raw = {**RAW, **changes}
    ours = parse_hf_config(raw)
    theirs = SolarOpenConfig(**{k: v for k, v in raw.items() if v is not None})
    for field in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "n_group",
                  "topk_group", "norm_topk_prob", "routed_scaling_factor", "num_key_value_heads", "rms_norm_eps",
                  "attention_bias", "tie_word_embeddings", "max_position_embeddings", "hidden_act", "head_dim"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == theirs.rope_parameters.get("factor")
    assert ours.sparse_layers == (True,) * 3 and ours.first_k_dense_replace == 0
    assert ours.rotary_dim == ours.head_dim and not ours.qk_norm
    assert ours.sliding_windows == (None,) * 3
    assert ours.sigmoid_scoring and ours.choice_bias and ours.group_limited
    assert ours.shared_expert_intermediate_size == theirs.n_shared_experts * theirs.moe_intermediate_size


def test_fields_left_out_take_solaropenconfig_defaults() -> None:
    from transformers import SolarOpenConfig

    raw = {"architectures": ["SolarOpenForCausalLM"], "model_type": "solar_open"}
    ours, theirs = parse_hf_config(raw), SolarOpenConfig()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings", "rms_norm_eps", "n_routed_experts", "num_experts_per_tok",
                  "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor", "n_group", "topk_group",
                  "norm_topk_prob", "tie_word_embeddings", "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ({"n_group": 3}, "n_group=3, topk_group=1 do not fit"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"head_dim": None}, "head_dim is null"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}, "moe_intermediate_size": 48},
     "group_size=64 does not divide in_features 48"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("changes", [
    {}, {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "n_shared_experts": 0, "attention_bias": False,
         "tie_word_embeddings": True, "num_experts_per_tok": 2},
])
def test_variants_with_a_correction_bias_match_transformers(changes, tmp_path) -> None:
    """The preset (groups of 2, top-3 renormalized x 2.0, two shared experts, biased q / k / v) and one group with
    the weights left as scored, no shared expert, unbiased attention, tied embeddings and stacked experts; random
    correction biases."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "solar_open", seed=5, tokenizer=False, **changes)
    redraw_correction_bias(model_dir, seed=7, stacked=bool(changes))  # the variant in transformers 5's layout
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    layers = model.model.layers
    assert all(type(layer.mlp) is DeepseekMoE for layer in layers)
    assert layers[0].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert (layers[1].self_attn.qkv_proj.bias is not None) == changes.get("attention_bias", True)
    assert layers[1].self_attn.o_proj.bias is None
    assert DECODER_STACK in model.fusions()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' and experts' feature slices; expert parallel ranks hold 4 experts."""
    model_dir = build_tiny_model(tmp_path, "solar_open", seed=2, tokenizer=False)
    redraw_correction_bias(model_dir, seed=3)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir, **options)
