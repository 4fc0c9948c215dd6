"""CWM (Meta's Code World Model: Llama with sliding-window layers per layer_types): config.json read as transformers'
CwmConfig reads it (its defaults, the default layer pattern and llama3 RoPE), refusals, explicit layer_types and
plain RoPE against transformers, and tensor parallelism. The tiny preset's paged-forward and engine parity run in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["CwmForCausalLM"], "model_type": "cwm", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
       "sliding_window": 8}


def _compare(ours, theirs) -> None:
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                  "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.sliding_windows == tuple(theirs.sliding_window if t == "sliding_attention" else None
                                         for t in theirs.layer_types)
    params = dict(theirs.rope_parameters)
    assert ours.rope_theta == params.pop("rope_theta")
    if params.pop("rope_type") == "default":
        assert ours.rope_scaling is None
    else:
        assert {k: ours.rope_scaling[k] for k in params} == params


@pytest.mark.parametrize("changes", [
    {}, {"layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"], "sliding_window": 4096},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": True,
     "rms_norm_eps": 1e-6, "eos_token_id": 7},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import CwmConfig

    _compare(parse_hf_config({**RAW, **changes}), CwmConfig(**{**RAW, **changes}))


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import CwmConfig

    _compare(parse_hf_config({"architectures": ["CwmForCausalLM"], "model_type": "cwm"}), CwmConfig())


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"rope_theta": 500000.0}, "rope_theta=500000.0 without rope_parameters"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive int"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"layer_types": ["full_attention"] * 2}, "expected 5 entries"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "CwmForCausalLM loads float checkpoints"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("changes", [
    {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 5},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": True},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """Explicit layer_types (a sliding first layer, window 5); plain RoPE with a tied head."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "cwm", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    types = changes.get("layer_types", ["full_attention", "sliding_attention", "sliding_attention"])
    window = changes.get("sliding_window", 8)
    assert llm.engine.parts.model.config.sliding_windows == tuple(
        window if t == "sliding_attention" else None for t in types)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "cwm", "cwm", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
