"""MiniCPM3 (DeepSeek's multi-head latent attention with half-split RoPE and MiniCPM's embedding, residual and logits
scalings): config.json read as transformers' MiniCPM3Config reads it, the variants (no q bottleneck, no-op scalings,
LongRoPE's short set) against transformers, refusals, and tensor parallelism. The tiny preset's paged-forward and
engine parity run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import math

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3", "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
       "vocab_size": 256, "max_position_embeddings": 512, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8}
_SHORT = [1.0, 1.5, 2.0, 4.0]  # qk_rope_head_dim / 2 divisors
LONGROPE = {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": 512}


def _compare(ours, theirs) -> None:
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.embedding_multiplier == theirs.scale_emb
    assert ours.residual_multiplier == pytest.approx(theirs.scale_depth / math.sqrt(theirs.num_hidden_layers))
    assert ours.logits_scaling == pytest.approx(theirs.logits_scaling)
    assert ours.softmax_scale == pytest.approx(theirs.qk_head_dim**-0.5)
    assert not ours.rope_interleaved


@pytest.mark.parametrize("changes", [
    {}, {"q_lora_rank": None, "v_head_dim": 8, "attention_bias": True, "rms_norm_eps": 1e-3},
    {"scale_depth": None, "dim_model_base": None, "scale_emb": 3, "tie_word_embeddings": False},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}, "max_position_embeddings": 4096},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import MiniCPM3Config

    _compare(parse_hf_config({**RAW, **changes}), MiniCPM3Config(**{**RAW, **changes}))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import MiniCPM3Config

    _compare(parse_hf_config({"architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3"}), MiniCPM3Config())


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
    ({"scale_emb": -1}, "scale_emb=-1"),
    ({"rope_scaling": {**LONGROPE, "original_max_position_embeddings": 64}}, "past original_max_position_embeddings"),
    ({"rope_scaling": {**LONGROPE, "short_factor": [1.0]}}, "invalid longrope settings"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "pre-quantized MiniCPM3ForCausalLM"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("changes", [
    {"q_lora_rank": None, "tie_word_embeddings": False, "attention_bias": True},
    {"scale_depth": None, "dim_model_base": None, "scale_emb": 1},
    {"rope_scaling": LONGROPE, "max_position_embeddings": 512},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """A plain q_proj with an untied head and biased MLA projections; the scalings made no-ops; LongRoPE within its
    original length (MiniCPM3-4B's own setting), where only the short factors turn the features."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "minicpm3", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert hasattr(model.model.layers[0].self_attn, "q_proj") == (changes.get("q_lora_rank", 32) is None)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' rows of q_b_proj and kv_b_proj and its columns of o_proj and the MLP."""
    model_dir = build_tiny_model(tmp_path / "minicpm3", "minicpm3", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
