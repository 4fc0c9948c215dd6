"""OLMo, first generation (Llama's stack with LayerNorms that hold no parameters, q / k / v clamped at clip_qkv):
config.json read as transformers' OlmoConfig reads it, the variants (no clamp, attention biases, a tied head, GQA,
scaled RoPE, an explicit head_dim) against transformers, the norms' missing tensors, and tensor parallelism. The tiny
preset's paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.norm import LayerNorm
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["OlmoForCausalLM"], "model_type": "olmo", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.mark.parametrize("changes", [
    {}, {"clip_qkv": 8.0, "num_key_value_heads": 2, "rope_theta": 500000.0, "tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True, "head_dim": 32,
     "max_position_embeddings": 4096, "eos_token_id": 2, "bos_token_id": 1},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}, "num_key_value_heads": None},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import OlmoConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), OlmoConfig(**{**RAW, **changes})
    assert ours.clip_qkv == theirs.clip_qkv
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (ours.rope_scaling or {}).get("factor") == theirs.rope_parameters.get("factor")
    assert ours.head_dim == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    for field in ("num_key_value_heads", "tie_word_embeddings", "attention_bias", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == 1e-5 and not ours.mlp_bias  # OlmoLayerNorm's fixed eps; OlmoMLP has no bias


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import OlmoConfig

    ours, theirs = parse_hf_config({"architectures": ["OlmoForCausalLM"], "model_type": "olmo"}), OlmoConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings", "hidden_act", "attention_bias", "clip_qkv"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rope_scaling is None


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"clip_qkv": -1.0}, "clip_qkv"),
    ({"clip_qkv": "8"}, "clip_qkv"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"rope_scaling": [1, 2]}, "must be an object or null"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


def test_the_norms_hold_no_tensors(tmp_path) -> None:
    """Every norm is a LayerNorm whose unit scale is a buffer, so the checkpoint (which has no norm tensors) loads
    and a stray norm tensor is refused."""
    model_dir = build_tiny_model(tmp_path, "olmo", seed=1, tokenizer=False)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=64, num_kv_blocks=16)
    model = llm.engine.parts.model
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    assert len(norms) == 5 and all(n.bias is None and not n.weight.requires_grad for n in norms)
    assert not any("norm" in name for name, _ in model.named_parameters())
    with pytest.raises(ModelLoadError, match="does not know: model.norm.weight"):
        model.load_weights([("model.norm.weight", torch.ones(64))])


@pytest.mark.parametrize("changes", [
    {"clip_qkv": None}, {"attention_bias": True, "tie_word_embeddings": True},
    {"num_key_value_heads": 4, "head_dim": 32, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset clamps at 0.5 with GQA and untied head; no clamp (OLMo-1B / 7B), biased attention under a tied
    head, and full multi-head attention with head_dim past hidden / heads and linearly scaled RoPE, against
    transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "olmo", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert model.model.layers[0].self_attn.clip_qkv == changes.get("clip_qkv", 0.5)
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == changes.get("attention_bias", False)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(changes.get("tie_word_embeddings"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank clamps and attends over its own heads; the unit norms need no shard."""
    model_dir = build_tiny_model(tmp_path / "olmo", "olmo", seed=2, tokenizer=False, attention_bias=True)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
