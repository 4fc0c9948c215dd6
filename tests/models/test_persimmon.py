"""Persimmon (transformers' PersimmonForCausalLM, adept/persimmon-8b): config.json read as PersimmonConfig reads it, the
fused per-head query_key_value cut into q / k / v, the variants without q / k LayerNorms, with another rotary fraction
and activation against transformers, and two tensor-parallel ranks. The tiny preset's paged-forward and engine parity
with transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.persimmon import PersimmonForCausalLM
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

RAW = {"architectures": ["PersimmonForCausalLM"], "model_type": "persimmon", "hidden_size": 64,
       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.mark.parametrize("changes", [
    {}, {"rope_theta": 25000.0, "partial_rotary_factor": 0.25, "layer_norm_eps": 1e-3, "qk_layernorm": False},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0, "partial_rotary_factor": 1.0},
     "hidden_act": "gelu", "tie_word_embeddings": True, "max_position_embeddings": 4096},
    {"num_key_value_heads": 2, "rms_norm_eps": 0.5},  # keys PersimmonConfig does not read
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import PersimmonConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), PersimmonConfig(**{**RAW, **changes})
    head_dim = theirs.hidden_size // theirs.num_attention_heads
    assert ours.rotary_dim == int(head_dim * theirs.rope_parameters["partial_rotary_factor"])
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == theirs.rope_parameters.get("factor")
    assert ours.rms_norm_eps == theirs.layer_norm_eps
    assert (ours.head_dim, ours.num_key_value_heads) == (head_dim, theirs.num_attention_heads)
    assert ours.raw.get("qk_layernorm", True) == theirs.qk_layernorm
    for field in ("tie_word_embeddings", "hidden_act", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import PersimmonConfig

    ours = parse_hf_config({"architectures": ["PersimmonForCausalLM"], "model_type": "persimmon"})
    theirs = PersimmonConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == theirs.layer_norm_eps
    assert ours.rotary_dim == int(64 * theirs.rope_parameters["partial_rotary_factor"]) == 32
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ({"qk_layernorm": "yes"}, "qk_layernorm='yes' must be true or false"),
    ({"num_attention_heads": 5}, "hidden_size=64 is not a multiple of num_attention_heads=5"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("changes", [{"qk_layernorm": False}, {"partial_rotary_factor": 1.0, "hidden_act": "gelu"}],
                         ids=["no-qk-layernorm", "full-rotary-gelu"])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset is persimmon-8b's layout (q / k LayerNorms, half-head RoPE, relu2); without the q / k norms, and
    with RoPE over whole heads and another activation, against transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "persimmon", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=32)
    attn = llm.engine.parts.model.model.layers[0].self_attn
    assert type(llm.engine.parts.model) is PersimmonForCausalLM
    assert (attn.q_norm is None) == (changes.get("qk_layernorm") is False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_the_checkpoint_s_tensors_land_where_transformers_reads_them(tmp_path) -> None:
    """Head h's q rows of query_key_value sit at rows 3h x head_dim (not in the first third); the q / k LayerNorms
    keep their biases."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "persimmon", seed=6, tokenizer=False)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=64, num_kv_blocks=8)
    attn = llm.engine.parts.model.model.layers[1].self_attn
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.layers[1].self_attn
    per_head = theirs.query_key_value.weight.view(4, 3, 16, 64)
    torch.testing.assert_close(attn.qkv_proj.weight[16:32], per_head[1, 0], atol=0, rtol=0)
    torch.testing.assert_close(attn.qkv_proj.weight[64:80], per_head[0, 1], atol=0, rtol=0)
    assert type(attn.q_norm) is LayerNorm
    torch.testing.assert_close(attn.k_norm.bias, theirs.k_layernorm.bias, atol=0, rtol=0)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' rows of every fused query_key_value; the shared q / k norms whole."""
    model_dir = build_tiny_model(tmp_path, "persimmon", seed=2, tokenizer=False)
    two_ranks_decode_as_one([random_tokens(30, 256, seed=3), [7, 3, 250]], model_dir)
