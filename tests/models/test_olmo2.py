"""OLMo 2 (norms after each branch, q / k normalized over all heads together): tensor parallel ranks as one rank,
and GGUF `olmo2` files written by flashllm's llama.cpp exporter loading as llama.cpp runs them. The tiny model's
paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py with the
other presets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.llm import LLM  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("olmo2"), "olmo2", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"olmo2": source})
    return lambda file_type: get("olmo2", file_type)


def test_the_file_holds_the_converter_s_names(source, files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    for part, module in (("attn_q_norm", "self_attn.q_norm"), ("post_attention_norm", "post_attention_layernorm"),
                         ("post_ffw_norm", "post_feedforward_layernorm")):
        assert np.array_equal(stored[f"blk.1.{part}.weight"], weights[f"model.layers.1.{module}.weight"].numpy())
    assert stored["blk.1.attn_q_norm.weight"].shape == (64,)  # all four heads of 16 together
    assert "blk.1.attn_norm.weight" not in stored and "blk.1.ffn_norm.weight" not in stored


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    assert load_hf_config(files("f32")).architecture == "Olmo2ForCausalLM"
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_an_olmo3_file_with_sliding_windows_is_refused(files, tmp_path) -> None:
    copy = rewritten_copy(files("f32"), tmp_path / "olmo3.gguf",
                          lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                          values={"olmo2.attention.sliding_window": 4096})
    with pytest.raises(ModelLoadError, match="sliding_window is set"):
        load_hf_config(copy)


@pytest.mark.parametrize("preset", ["olmo2", "olmo3"])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(preset, tmp_path) -> None:
    """Each rank normalizes the gathered whole query and key projections, then keeps its heads."""
    model_dir = build_tiny_model(tmp_path / preset, preset, seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)


def test_key_heads_that_do_not_split_over_the_ranks_are_refused_with_the_flag_to_change(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "odd", "olmo2", seed=2, tokenizer=False, num_key_value_heads=1)
    with pytest.raises(Exception, match="--tensor-parallel-size that divides 1"):
        LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
            block_size=16, num_kv_blocks=16)


OLMO3 = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "pad_token_id": 0, "sliding_window": 16}


@pytest.mark.parametrize("changes", [
    {}, {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                                  "original_max_position_embeddings": 64}},
    {"layer_types": ["sliding_attention", "full_attention"] * 4},
    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
])
def test_an_olmo3_config_reads_as_transformers_reads_it(changes) -> None:
    """Sliding layers by layer_types (three sliding, then a full one, by default); the full layers' RoPE and the
    sliding layers' as transformers' Olmo3Config sets them up."""
    from transformers import Olmo3Config

    from flashllm.models.hf_config import parse_hf_config

    ours, theirs = parse_hf_config({**OLMO3, **changes}), Olmo3Config(**{**OLMO3, **changes})
    assert ours.sliding_windows == tuple(16 if t == "sliding_attention" else None for t in theirs.layer_types)
    for kind, (theta, scaling) in (("full_attention", (ours.rope_theta, ours.rope_scaling)),
                                   ("sliding_attention", ours.local_rope)):
        params = dict(theirs.rope_parameters[kind])
        assert theta == params.pop("rope_theta"), kind
        kind_type = params.pop("rope_type")
        assert (scaling or {"rope_type": "default"})["rope_type"] == kind_type, kind
        for key, value in params.items():
            assert scaling[key] == value, (kind, key)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"rope_theta": 1e4}, "rope_theta=10000 without per-layer-type rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "must map full_attention and sliding"),
])
def test_olmo3_rope_layouts_transformers_reads_otherwise_are_refused(changes, fragment) -> None:
    from flashllm.models.hf_config import parse_hf_config

    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**OLMO3, **changes})
