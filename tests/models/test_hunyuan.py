"""Hunyuan dense (HunYuanDenseV1ForCausalLM): the fixed NTK alpha read into the RoPE base as transformers computes it,
in both config layouts, and the checkpoint's query_layernorm / key_layernorm names. The tiny model's paged-forward and
engine parity with transformers (norms after RoPE, alpha 50) run in test_parity_forward.py and test_engine_parity.py
with the other presets; GGUF `hunyuan-dense` files written by flashllm's llama.cpp exporter load as llama.cpp runs them."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.ops.rope_cache import rope_inv_freq

RAW = {"architectures": ["HunYuanDenseV1ForCausalLM"], "model_type": "hunyuan_v1_dense", "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512}
PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}},
    {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}},  # the Hub's
])
def test_the_alpha_stretches_the_rope_base_as_transformers_does(rope) -> None:
    from transformers import HunYuanDenseV1Config
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    ours = parse_hf_config({**RAW, **rope})
    theirs = HunYuanDenseV1RotaryEmbedding(HunYuanDenseV1Config(**{**RAW, **rope})).inv_freq
    assert ours.rope_scaling is None
    inv_freq, _ = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(inv_freq.float(), theirs.float(), rtol=1e-6, atol=0)
    plain, _ = rope_inv_freq(32, 10000.0, None)
    assert (plain - inv_freq).abs().max() > 1e-3


def test_an_alpha_on_another_rope_type_is_refused_in_one_line() -> None:
    with pytest.raises(ModelLoadError, match="rope alpha with rope type 'linear'") as info:
        parse_hf_config({**RAW, "rope_scaling": {"type": "linear", "factor": 2.0, "alpha": 3.0}})
    assert "\n" not in str(info.value)


def test_the_checkpoint_names_its_head_norms_query_layernorm_and_key_layernorm(tmp_path) -> None:
    from safetensors import safe_open

    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "hunyuan", seed=1, tokenizer=False)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.query_layernorm.weight", "model.layers.0.self_attn.key_layernorm.weight"} <= names


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from flashllm.testing.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hunyuan"), "hunyuan", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    pytest.importorskip("gguf")
    from flashllm.testing.gguf_files import exports

    get = exports(tmp_path_factory.mktemp("gguf"), {"hunyuan": source})
    return lambda file_type: get("hunyuan", file_type)


def test_a_gguf_file_carries_the_alpha_in_its_rope_base(source, files) -> None:
    from flashllm.models.hf_config import load_hf_config

    ours, expected = load_hf_config(files("f32")), load_hf_config(source)
    assert ours.architecture == "HunYuanDenseV1ForCausalLM" and ours.rope_scaling is None
    assert ours.rope_theta == pytest.approx(expected.rope_theta, rel=1e-6)  # folded alpha, not the plain 10000
    assert ours.rope_theta > 10000.0 * 50


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    from flashllm.testing.gguf_files import check_f32_file

    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    from flashllm.testing.gguf_files import check_q8_0_logits, load_float_model

    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")
