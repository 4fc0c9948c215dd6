"""Gemma 2 GGUF files (`gemma2`), written by flashllm's llama.cpp exporter from a tiny transformers Gemma2ForCausalLM
(the preset's caps low enough to bite, its sliding window shorter than the prompt), load as llama.cpp runs them: the
directory's configuration, F32 logits equal to the directory's and greedy tokens equal to transformers', Q8_0 as the
directory rounded through Q8_0, and llama.cpp's defaults for the keys a file leaves out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    check_q8_0_logits,
    export_of,
    load_float_model,
    rewritten_copy,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
CONFIG_FIELDS = ("architecture", "sliding_windows", "attn_logit_softcapping", "final_logit_softcapping",
                 "query_pre_attn_scalar", "head_dim", "num_key_value_heads", "rope_theta", "local_rope_theta",
                 "qk_norm", "tie_word_embeddings", "vocab_size")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # llama.cpp's shape rule: query_pre_attn_scalar is the head size (32) below 46 layers
    return build_tiny_model(tmp_path_factory.mktemp("gemma2"), "gemma2", seed=3, query_pre_attn_scalar=32)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "gemma2", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files):
    reader = gguf.GGUFReader(files("f32"))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("gemma2.")}
    assert fields["gemma2.attention.sliding_window"] == 8
    assert (fields["gemma2.attn_logit_softcapping"], fields["gemma2.final_logit_softcapping"]) == (1.5, 3.0)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    np.testing.assert_allclose(stored["blk.1.post_ffw_norm.weight"],
                               weights["model.layers.1.post_feedforward_layernorm.weight"].numpy() + 1, rtol=1e-6)
    assert "blk.1.attn_q_norm.weight" not in stored


def test_config_is_the_directory_s(source, files):
    check_config_fields(files("f32"), source, CONFIG_FIELDS, approx=())


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_a_file_without_the_optional_keys_gets_llama_cpp_s_defaults(files, tmp_path):
    same = rewritten_copy(files("f32"), tmp_path / "bare.gguf",
                          lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                          dropped=("sliding_window", "logit_softcapping"))
    config = load_hf_config(same)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.sliding_windows == (4096, None, 4096, None)


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"query_pre_attn_scalar": 24}, "query_pre_attn_scalar=24"),
    ({"final_logit_softcapping": None}, "without a score or logit cap"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "llama.cpp's gemma2 slides the even layers"),
])
def test_the_exporter_refuses_what_llama_cpp_would_run_differently(overrides, fragment, tmp_path):
    directory = build_tiny_model(tmp_path / "model", "gemma2", seed=1, tokenizer=False,
                                 **{"query_pre_attn_scalar": 32, **overrides})
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(directory, tmp_path / "model.gguf")
