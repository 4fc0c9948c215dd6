"""dots.llm1 (Dots1ForCausalLM): config.json read as transformers' Dots1Config reads it (routing defaults, sliding
layers from max_window_layers or layer_types, the routing fields transformers does not read), a random
e_score_correction_bias and the variants (no groups, weights not renormalized, biased attention) against
transformers, and two tensor-parallel and two expert-parallel ranks. The tiny preset's paged-forward and engine
parity with transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2}
# dots.llm1.inst's routing fields (its config.json also writes the scoring / top-k method transformers does not read)
INST = {"num_key_value_heads": 4, "first_k_dense_replace": 1, "moe_intermediate_size": 48, "n_shared_experts": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5, "rope_theta": 10000000.0,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 4, "scoring_func": "noaux_tc",
        "n_group": 1, "topk_group": 1, "moe_layer_freq": 1}


@pytest.mark.parametrize("changes", [
    {}, INST,
    {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "attention_bias": True, "num_key_value_heads": 2,
     "sliding_window": 16, "max_window_layers": 2, "head_dim": 32, "tie_word_embeddings": True},
    {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import Dots1Config

    ours, theirs = parse_hf_config({**RAW, **changes}), Dots1Config(**{**RAW, **changes})
    for field in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                  "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                  "num_key_value_heads", "rms_norm_eps", "attention_bias", "tie_word_embeddings",
                  "max_position_embeddings", "hidden_act", "intermediate_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.sliding_windows == tuple(theirs.sliding_window if kind == "sliding_attention" else None
                                         for kind in theirs.layer_types)
    assert ours.sparse_layers == tuple(i >= theirs.first_k_dense_replace for i in range(4))
    assert ours.qk_norm and ours.sigmoid_scoring and ours.choice_bias and ours.group_limited
    assert ours.shared_expert_intermediate_size == theirs.n_shared_experts * theirs.moe_intermediate_size


def test_fields_left_out_take_dots1config_defaults() -> None:
    from transformers import Dots1Config

    raw = {key: value for key, value in RAW.items() if key != "num_key_value_heads"}
    raw.update(num_attention_heads=32, hidden_size=512, num_hidden_layers=64)
    ours, theirs = parse_hf_config(raw), Dots1Config(**raw)
    assert (ours.num_key_value_heads, ours.moe_intermediate_size, ours.routed_scaling_factor, ours.norm_topk_prob,
            ours.first_k_dense_replace) == (theirs.num_key_value_heads, theirs.moe_intermediate_size,
                                            theirs.routed_scaling_factor, theirs.norm_topk_prob,
                                            theirs.first_k_dense_replace)
    assert ours.sliding_windows == tuple(4096 if kind == "sliding_attention" else None for kind in theirs.layer_types)
    assert ours.sliding_windows[61:] == (None, 4096, 4096)  # from max_window_layers = 62 on


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"n_routed_experts": None}, "missing 'n_routed_experts'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ({"n_group": 3}, "n_group=3, topk_group=1 do not fit"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}, "moe_intermediate_size": 48},
     "group_size=32 does not divide moe_intermediate_size=48"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


def _with_random_correction_bias(model_dir, seed: int) -> None:
    """The tiny checkpoint's e_score_correction_bias (zeros as transformers initializes it) redrawn, so that it
    changes which experts are chosen."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors, gen = load_file(path), torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.2
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("changes", [{}, {"n_group": 1, "norm_topk_prob": False, "attention_bias": True},
                                     {"n_shared_experts": 2, "routed_scaling_factor": 2.5, "n_group": 4,
                                      "topk_group": 2, "num_experts_per_tok": 2, "sliding_window": None,
                                      "layer_types": None}])
def test_variants_with_a_correction_bias_match_transformers(changes, tmp_path) -> None:
    """The preset (groups of 4, top-3 renormalized x 1.5, a sliding layer), one group with the weights left as scored
    and biased attention, and two shared experts with 4 groups, each with a random correction bias."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "dots1", seed=5, tokenizer=False, **changes)
    _with_random_correction_bias(model_dir, seed=7)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    layers = model.model.layers
    assert type(layers[0].mlp) is GatedMLP and type(layers[2].mlp) is DeepseekMoE
    assert layers[2].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert (layers[1].self_attn.o_proj.bias is not None) == changes.get("attention_bias", False)
    assert layers[1].self_attn.attn.sliding_window == (8 if "sliding_window" not in changes else None)
    assert DECODER_STACK in model.fusions()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' and experts' feature slices; expert parallel ranks hold 4 experts."""
    model_dir = build_tiny_model(tmp_path, "dots1", seed=2, tokenizer=False)
    _with_random_correction_bias(model_dir, seed=3)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir, **options)
