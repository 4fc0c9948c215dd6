"""AFMoE (AfmoeForCausalLM, Arcee Trinity): config.json read as transformers' AfmoeConfig reads it (defaults, the
sliding / full layer pattern, the routing fields), refusals, variants (no muP, one shared expert, every layer
sparse, biased attention, tied embeddings, explicit layer_types) against transformers, and two tensor-parallel and
two expert-parallel ranks. The tiny preset's paged-forward and engine parity with transformers run in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.afmoe import AfmoeAttention
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["AfmoeForCausalLM"], "model_type": "afmoe", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# Trinity-Mini's own fields (sizes shrunk), with the routing fields transformers does not read
MINI = {"num_dense_layers": 2, "num_shared_experts": 1, "route_scale": 2.826, "mup_enabled": True,
        "global_attn_every_n_layers": 4, "sliding_window": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_theta": 10000, "max_position_embeddings": 131072, "score_func": "sigmoid", "route_norm": True,
        "n_group": 1, "topk_group": 1}


@pytest.mark.parametrize("changes", [
    {}, MINI,
    {"global_attn_every_n_layers": 2, "num_shared_experts": 0, "num_dense_layers": 0, "attention_bias": True,
     "num_key_value_heads": None, "tie_word_embeddings": True, "head_dim": None},
    {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 8, "num_experts_per_tok": 8},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import AfmoeConfig

    raw = {**RAW, **changes}
    ours, theirs = parse_hf_config(raw), AfmoeConfig(**raw)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_key_value_heads",
                  "rms_norm_eps", "attention_bias", "tie_word_embeddings", "max_position_embeddings", "hidden_act",
                  "intermediate_size", "hidden_size", "vocab_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.head_dim == (theirs.head_dim or theirs.hidden_size // theirs.num_attention_heads)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.routed_scaling_factor == theirs.route_scale
    assert ours.n_shared_experts == theirs.num_shared_experts
    assert ours.shared_expert_intermediate_size == theirs.num_shared_experts * theirs.moe_intermediate_size
    assert ours.sparse_layers == tuple(i >= theirs.num_dense_layers for i in range(4))
    assert ours.sliding_windows == tuple(theirs.sliding_window if kind == "sliding_attention" else None
                                         for kind in theirs.layer_types)
    assert ours.rope_layers == tuple(kind == "sliding_attention" for kind in theirs.layer_types)
    assert ours.embedding_multiplier == (theirs.hidden_size**0.5 if theirs.mup_enabled else 1.0)
    assert ours.qk_norm and ours.sigmoid_scoring and ours.choice_bias and ours.norm_topk_prob
    assert not ours.group_limited


def test_fields_left_out_take_afmoeconfig_defaults() -> None:
    from transformers import AfmoeConfig

    raw = {"architectures": ["AfmoeForCausalLM"], "model_type": "afmoe"}
    ours, theirs = parse_hf_config(raw), AfmoeConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rms_norm_eps", "num_experts", "num_experts_per_tok", "tie_word_embeddings", "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.n_shared_experts, ours.first_k_dense_replace, ours.routed_scaling_factor) == (
        theirs.num_shared_experts, theirs.num_dense_layers, theirs.route_scale)
    assert ours.sliding_windows == tuple(theirs.sliding_window if kind == "sliding_attention" else None
                                         for kind in theirs.layer_types)
    assert ours.embedding_multiplier == 1.0 and ours.rope_theta == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"num_dense_layers": 5}, "num_dense_layers=5 must be an int in 0..4"),
    ({"num_shared_experts": -1}, "num_shared_experts=-1 must be an int"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list 4 entries"),
    ({"sliding_window": None}, "sliding_window is null"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}, "loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


def _llm(model_dir) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)


@pytest.mark.parametrize("changes", [
    {"mup_enabled": False, "num_shared_experts": 1, "num_dense_layers": 0, "attention_bias": True},
    {"tie_word_embeddings": True, "route_scale": 1.0, "num_experts_per_tok": 1, "num_shared_experts": 0,
     "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """No muP with one shared expert, every layer sparse and biased attention; tied embeddings, top-1 unscaled, no
    shared expert (transformers writes its empty tensors), an explicit layer pattern and stacked experts."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "afmoe", seed=5, tokenizer=False, **changes)
    if changes.get("tie_word_embeddings"):  # this one saved in transformers 5's layout (stacked experts)
        AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(model_dir, save_original_format=False)
    llm = _llm(model_dir)
    layers = llm.engine.parts.model.model.layers
    assert (type(layers[0].mlp) is GatedMLP) == bool(changes.get("num_dense_layers", 1))
    assert type(layers[3].mlp) is DeepseekMoE and layers[3].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert isinstance(layers[1].self_attn, AfmoeAttention)
    assert (layers[1].self_attn.o_proj.bias is not None) == changes.get("attention_bias", False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)


def test_full_layers_skip_rope_and_the_gate_changes_the_output(tmp_path) -> None:
    """The preset's full layers (1, 3) carry no rotary table; zeroing one layer's output gate changes the logits
    (the gate is applied, not loaded and ignored)."""
    model_dir = build_tiny_model(tmp_path, "afmoe", seed=1, tokenizer=False)
    llm = _llm(model_dir)
    model = llm.engine.parts.model
    kinds = [type(layer.self_attn.rotary_emb) is NoPositionEmbedding for layer in model.model.layers]
    assert kinds == [False, True, False, True]
    prompt = PROMPT[:10]  # within one block: no prefix-cache hit on the second run
    before = llm.generate([prompt], _greedy())[0].outputs[0].logprobs
    model.model.layers[1].self_attn.attn_gate.weight.data.fill_(-30.0)
    after = llm.generate([prompt], _greedy())[0].outputs[0].logprobs
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3


def _greedy():
    from flashllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' (and gates') and experts' feature slices; expert parallel ranks hold
    4 experts each."""
    model_dir = build_tiny_model(tmp_path, "afmoe", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir, **options)
