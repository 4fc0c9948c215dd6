"""Nemotron (1 + w LayerNorms, an ungated relu² MLP, RoPE over half of each head): config.json read as transformers'
NemotronConfig reads it, biases honored, tensor parallelism, and GGUF `nemotron` files written by flashllm's llama.cpp
exporter loading as llama.cpp runs them. The tiny preset's paged-forward and engine parity with transformers run in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.llm import LLM  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config, parse_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    two_ranks_decode_as_one,
)
from flashllm.testing.parity import check_engine_greedy_against, random_tokens  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.mark.parametrize("changes", [{}, {"partial_rotary_factor": 1.0, "norm_eps": 1e-3, "num_key_value_heads": 2},
                                     {"head_dim": 32, "attention_bias": True, "mlp_bias": True}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import NemotronConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), NemotronConfig(**{**RAW, **changes})
    assert ours.rms_norm_eps == theirs.norm_eps
    assert ours.rotary_dim == int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"])
    kv_heads = theirs.num_key_value_heads or theirs.num_attention_heads  # NemotronConfig keeps None: all heads
    assert (ours.head_dim, ours.num_key_value_heads, ours.max_position_embeddings) == (
        theirs.head_dim, kv_heads, theirs.max_position_embeddings)
    assert (ours.hidden_act, ours.attention_bias, ours.mlp_bias, ours.tie_word_embeddings) == (
        theirs.hidden_act, theirs.attention_bias, theirs.mlp_bias, theirs.tie_word_embeddings)


def test_a_gated_activation_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="hidden_act='silu' is not supported"):
        parse_hf_config({**RAW, "hidden_act": "silu"})


def test_biased_projections_match_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "nemotron", seed=5, tokenizer=False, attention_bias=True, mlp_bias=True)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    layer = llm.engine.parts.model.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.up_proj.bias is not None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "nemotron", "nemotron", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("nemotron"), "nemotron", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"nemotron": source})
    return lambda file_type: get("nemotron", file_type)


def test_the_file_holds_one_plus_w_norms_and_partial_rope(source, files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    assert np.allclose(stored["blk.1.attn_norm.weight"], weights["model.layers.1.input_layernorm.weight"].numpy() + 1)
    assert np.array_equal(stored["blk.1.attn_norm.bias"], weights["model.layers.1.input_layernorm.bias"].numpy())
    assert not any("ffn_gate" in name for name in stored)
    config = load_hf_config(files("f32"))
    assert (config.architecture, config.rotary_dim, config.head_dim, config.hidden_act) == (
        "NemotronForCausalLM", 8, 16, "relu2")


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")
