"""SmolLM3 (Llama's decoder with every fourth layer left without RoPE): config.json read as transformers'
SmolLM3Config reads it, and GGUF `smollm3` files written by flashllm's llama.cpp exporter loading as llama.cpp runs
them. The tiny model's paged-forward and engine parity with transformers run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashllm.bench.gguf_export import GGUFExportError, export_gguf
from flashllm.models.hf_config import ModelLoadError, load_hf_config, parse_hf_config
from flashllm.testing.gguf_files import check_f32_file, check_q8_0_logits, exports, load_float_model
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "pad_token_id": 0}


@pytest.mark.parametrize("changes", [{}, {"no_rope_layer_interval": 3},
                                     {"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]},
                                     {"use_sliding_window": True, "sliding_window": 16}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import SmolLM3Config

    ours, theirs = parse_hf_config({**RAW, **changes}), SmolLM3Config(**{**RAW, **changes})
    assert ours.rope_layers == tuple(bool(x) for x in theirs.no_rope_layers)
    assert ours.sliding_windows == tuple(theirs.sliding_window if t == "sliding_attention" else None
                                         for t in theirs.layer_types)
    assert not all(ours.rope_layers)


def test_a_malformed_no_rope_list_is_refused_in_one_line() -> None:
    with pytest.raises(ModelLoadError, match="no_rope_layers=") as info:
        parse_hf_config({**RAW, "no_rope_layers": [1, 2, 1, 1, 0, 1, 1, 1]})
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("smollm3"), "smollm3", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"smollm3": source})
    return lambda file_type: get("smollm3", file_type)


def test_a_gguf_file_loads_the_directory_s_config(source, files) -> None:
    ours, expected = load_hf_config(files("f32")), load_hf_config(source)
    assert ours.architecture == "SmolLM3ForCausalLM" and ours.rope_layers == expected.rope_layers
    assert ours.rope_layers == (True, True, True, False)


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_nope_layers_llama_cpp_would_place_otherwise_are_not_exported(tmp_path) -> None:
    directory = build_tiny_model(tmp_path / "model", "smollm3", seed=1, no_rope_layer_interval=2)
    with pytest.raises(GGUFExportError, match="every 4th layer only"):
        export_gguf(directory, tmp_path / "model.gguf")
