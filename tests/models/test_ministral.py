"""Ministral (transformers' MinistralForCausalLM, Ministral-8B-Instruct-2410): config.json read as MinistralConfig reads
it (per-layer `layer_types`, its defaults), the window on the sliding layers only, the layouts without layer_types
against transformers, and two tensor-parallel ranks. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.mistral import MinistralForCausalLM
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import PRESETS, TINY_BASE, build_tiny_model

RAW = {"architectures": ["MinistralForCausalLM"], "model_type": "ministral", **TINY_BASE, "vocab_size": 256,
       **PRESETS["ministral"][1]}
SLIDING, FULL = "sliding_attention", "full_attention"


def _windows(theirs) -> tuple[int | None, ...]:
    """Each layer's window as transformers' MinistralAttention takes it."""
    return tuple(theirs.sliding_window if t == SLIDING else None for t in theirs.layer_types)


@pytest.mark.parametrize("changes", [
    {}, {"layer_types": None}, {"sliding_window": None, "layer_types": None},
    {"layer_types": [FULL, FULL, SLIDING], "sliding_window": 300, "head_dim": 32, "tie_word_embeddings": True},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "num_key_value_heads": 4},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import MinistralConfig

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None or key == "sliding_window"}
    ours, theirs = parse_hf_config(raw), MinistralConfig(**raw)
    assert ours.sliding_windows == _windows(theirs)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.head_dim == (theirs.head_dim or theirs.hidden_size // theirs.num_attention_heads)
    for field in ("num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import MinistralConfig

    ours, theirs = parse_hf_config({"architectures": ["MinistralForCausalLM"], "model_type": "ministral"}), MinistralConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.sliding_windows == _windows(theirs) == (4096,) * 32
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rope_scaling is None


def test_only_the_sliding_layers_get_the_window(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path, "ministral", seed=1, tokenizer=False)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=32)
    model = llm.engine.parts.model
    assert type(model) is MinistralForCausalLM
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None, 8]


def test_every_layer_slides_without_layer_types_as_in_transformers(tmp_path) -> None:
    """Without layer_types transformers windows every layer. (A null window parses as all layers full, as
    MinistralConfig reads it, but transformers' model cannot run it: it always builds the sliding mask.)"""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "ministral", seed=4, tokenizer=False, layer_types=None)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (5, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path, "ministral", seed=2, tokenizer=False)
    two_ranks_decode_as_one([random_tokens(30, 256, seed=3), [7, 3, 250]], model_dir)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"layer_types": [SLIDING, FULL]}, "expected 3 entries"),
    ({"layer_types": [SLIDING, "chunked_attention", FULL]}, "expected 3 entries, each one of"),
    ({"sliding_window": None}, "sliding_window is null"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive int"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)
