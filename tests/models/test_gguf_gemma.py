"""Gemma 1 GGUF files (`gemma`), written by flashllm's llama.cpp exporter from a tiny transformers GemmaForCausalLM,
load as llama.cpp runs them: norms stored as 1 + w, F32 logits equal to the directory's and greedy tokens equal to
transformers', Q8_0 as the directory rounded through Q8_0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    check_q8_0_logits,
    export_of,
    load_float_model,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gemma"), "gemma", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "gemma", source)


def test_the_file_holds_gemma_s_norms_as_one_plus_w(source, files):
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "gemma"
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    np.testing.assert_allclose(stored["blk.1.ffn_norm.weight"],
                               weights["model.layers.1.post_attention_layernorm.weight"].numpy() + 1, rtol=1e-6)
    check_config_fields(files("f32"), source, ("architecture", "head_dim", "query_pre_attn_scalar", "sliding_windows",
                                               "tie_word_embeddings"), approx=())


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")
