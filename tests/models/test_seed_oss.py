"""Seed-OSS (Llama's decoder with q / k / v biases and an optional output-projection bias): config.json read as
transformers' SeedOssConfig reads it, the output bias honored against transformers, and GGUF `seed_oss` files written
by flashllm's llama.cpp exporter loading as llama.cpp runs them. The tiny preset's paged-forward and engine parity
with transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.bench.gguf_export import GGUFExportError, export_gguf
from flashllm.llm import LLM
from flashllm.models.hf_config import load_hf_config, parse_hf_config
from flashllm.testing.gguf_files import check_f32_file, check_q8_0_logits, exports, load_float_model
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["SeedOssForCausalLM"], "model_type": "seed_oss", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "max_position_embeddings": 512}


@pytest.mark.parametrize("changes", [{}, {"head_dim": None, "attention_bias": False}, {"attention_out_bias": True}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import SeedOssConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), SeedOssConfig(**{**RAW, **changes})
    assert (ours.head_dim, ours.attention_bias) == (theirs.head_dim, theirs.attention_bias)
    assert ours.rms_norm_eps == theirs.rms_norm_eps


def test_the_output_bias_is_honored(tmp_path) -> None:
    """attention_out_bias=true puts a bias on o_proj (the preset has none): the engine still matches transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "seed_oss", seed=5, tokenizer=False, attention_out_bias=True)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    assert llm.engine.parts.model.model.layers[0].self_attn.o_proj.bias is not None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("seed_oss"), "seed_oss", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"seed_oss": source})
    return lambda file_type: get("seed_oss", file_type)


def test_a_gguf_file_loads_the_directory_s_config(source, files) -> None:
    ours, expected = load_hf_config(files("f32")), load_hf_config(source)
    for field in ("architecture", "head_dim", "attention_bias", "num_key_value_heads", "rms_norm_eps", "vocab_size"):
        assert getattr(ours, field) == pytest.approx(getattr(expected, field)), field  # GGUF's eps is fp32
    assert ours.attention_bias and not ours.raw["attention_out_bias"]


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_an_output_bias_has_no_gguf_export(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "biased", "seed_oss", seed=1, attention_out_bias=True)
    with pytest.raises(GGUFExportError, match="attention_out_bias=true"):
        export_gguf(model_dir, tmp_path / "model.gguf")
