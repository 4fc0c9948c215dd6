"""IBM Granite-MoE GGUF files (`granitemoe`), written by flashllm's llama.cpp exporter from a tiny transformers
GraniteMoeForCausalLM directory (Granite's four multipliers far from 1, top-2 of 4 experts stacked as input_linear /
output_linear), load into the directory's model: the configuration the directory's own, F32 logits equal to the
directory's and greedy tokens equal to transformers', Q8_0 as the directory rounded through Q8_0, two ranks as one."""

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
    moe_source,
    two_ranks_decode_as_one,
)

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
CONFIG_FIELDS = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                 "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                 "head_dim", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "num_hidden_layers")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return moe_source(tmp_path_factory.mktemp("granitemoe"), "granitemoe", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "granitemoe", source)


def test_the_file_holds_the_converter_s_split_experts_and_scales(source, files):
    reader = gguf.GGUFReader(files("f32"))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("granitemoe.")}
    assert (fields["granitemoe.expert_count"], fields["granitemoe.expert_used_count"]) == (4, 2)
    assert fields["granitemoe.residual_scale"] == pytest.approx(0.22)
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    stacked = load_file(str(source / "model.safetensors"))["model.layers.1.block_sparse_moe.input_linear.weight"]
    assert np.array_equal(stored["blk.1.ffn_gate_exps.weight"], stacked[:, :96].numpy())  # gate rows first
    assert np.array_equal(stored["blk.1.ffn_up_exps.weight"], stacked[:, 96:].numpy())
    assert "blk.1.ffn_gate_inp.weight" in stored and "blk.1.ffn_down_exps.weight" in stored


def test_config_is_the_directory_s(source, files):
    check_config_fields(files("f32"), source, (), approx=CONFIG_FIELDS)


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded",
                      keep=("router.layer.weight",))


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_decode_a_q8_0_file_as_one(options, files, monkeypatch, exact_w8_products):
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("q8_0"), **options)
