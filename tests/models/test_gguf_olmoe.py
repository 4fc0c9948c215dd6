"""OLMoE GGUF files (`olmoe`), written by flashllm's llama.cpp exporter from a tiny transformers OlmoeForCausalLM
directory (whole-projection q / k RMSNorms, top-3 of 8 softmax experts not renormalized), load into the directory's
model: the converter's names and metadata, the directory's configuration, F32 logits equal to the directory's and
greedy tokens equal to transformers', Q8_0 as the directory rounded through Q8_0, two ranks as one; what llama.cpp's
olmoe graph would run differently (or not load) is refused, in export and in loading."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    check_q8_0_file,
    export_of,
    load_float_model,
    moe_source,
    patched_metadata,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_moe import build_moe_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# The tiny preset as llama.cpp's olmoe converter and graph take it: as many key heads as query heads (its k norm is
# embedding_length wide), the converter's epsilon 1e-5, experts 96 wide (whole Q8_0 blocks, unlike the hidden 64)
OVERRIDES = {"num_key_value_heads": 4, "rms_norm_eps": 1e-5, "intermediate_size": 96}
CONFIG_FIELDS = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                 "shared_expert_intermediate_size", "norm_topk_prob", "sparse_layers", "qkv_bias", "head_dim",
                 "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "num_hidden_layers",
                 "hidden_size", "rope_theta")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return moe_source(tmp_path_factory.mktemp("olmoe"), "olmoe", seed=3, **OVERRIDES)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "olmoe", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files):
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "olmoe"
    fields = {k.removeprefix("olmoe."): f.contents() for k, f in reader.fields.items() if k.startswith("olmoe.")}
    assert {k: fields[k] for k in ("expert_count", "expert_used_count", "feed_forward_length", "attention.head_count",
                                   "attention.head_count_kv", "block_count")} == {
        "expert_count": 8, "expert_used_count": 3, "feed_forward_length": 96, "attention.head_count": 4,
        "attention.head_count_kv": 4, "block_count": 2}
    assert fields["attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "expert_feed_forward_length" not in fields and "expert_weights_norm" not in fields
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    assert np.array_equal(stored["blk.1.attn_q.weight"], weights["model.layers.1.self_attn.q_proj.weight"])  # unpermuted
    assert np.array_equal(stored["blk.1.attn_k.weight"], weights["model.layers.1.self_attn.k_proj.weight"])
    for part in ("q", "k"):  # the whole projection's norm, embedding_length wide
        norm = stored[f"blk.1.attn_{part}_norm.weight"]
        assert norm.shape == (64,) and np.array_equal(norm, weights[f"model.layers.1.self_attn.{part}_norm.weight"])
    assert np.array_equal(stored["blk.1.ffn_gate_inp.weight"], weights["model.layers.1.mlp.gate.weight"])
    for gguf_part, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        expected = np.stack([weights[f"model.layers.1.mlp.experts.{e}.{proj}.weight"].numpy() for e in range(8)])
        assert np.array_equal(stored[f"blk.1.ffn_{gguf_part}_exps.weight"], expected), gguf_part  # (E, N, K)
    assert stored["blk.1.ffn_down_exps.weight"].shape == (8, 64, 96)
    assert {"output.weight", "blk.1.ffn_norm.weight"} <= set(stored) and not any(".bias" in n for n in stored)


def test_config_is_the_directory_s(source, files):
    check_config_fields(files("f32"), source, CONFIG_FIELDS)


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    types = {"blk.1.ffn_down_exps.weight": "Q8_0", "blk.1.attn_q.weight": "Q8_0",
             "blk.1.ffn_gate_inp.weight": "F32"}  # the converter keeps routers F32
    check_q8_0_file(files("q8_0"), source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded", types,
                    keep=(".gate.weight",))


def test_expert_weights_norm_in_a_file_does_not_renormalize(files, ops, model_registry, paged_driver, tmp_path):
    """llama.cpp's olmoe graph never renormalizes the top-k weights, whatever `olmoe.expert_weights_norm` says."""
    path = rewritten_copy(files("f32"), tmp_path / "norm.gguf",
                          lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                          values={"olmoe.expert_weights_norm": True})
    assert load_hf_config(path).norm_topk_prob is False
    expected = prompt_logits(load_float_model(files("f32"), ops, model_registry), paged_driver, PROMPT)
    torch.testing.assert_close(prompt_logits(load_float_model(path, ops, model_registry), paged_driver, PROMPT),
                               expected, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_decode_a_q8_0_file_as_one(options, files, monkeypatch, exact_w8_products):
    """Two ranks each norm the query and key over every head (gathered), or hold 4 whole experts of 8."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("q8_0"), **options)


@pytest.mark.parametrize("overrides,fragment", [
    ({"norm_topk_prob": True}, "never renormalizes the top-k routing weights"),
    ({"attention_bias": True}, "adds no attention biases"),
    ({"rms_norm_eps": 1e-6}, "its converter writes the epsilon as 1e-05"),
    ({"num_key_value_heads": 2}, "2 key heads of 4 has no GGUF export"),
    ({"tie_word_embeddings": True}, "its olmoe loader requires output.weight"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "writes plain or linear rope only"),
])
def test_what_llama_cpp_would_run_differently_is_not_exported(overrides, fragment, tmp_path):
    source = build_moe_model(tmp_path / "model", "olmoe", seed=1, **{**OVERRIDES, **overrides})
    with pytest.raises(GGUFExportError, match="OLMoE with") as err:
        export_gguf(source, tmp_path / "out.gguf")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def _copy(files, path: Path, values: dict | None = None, dropped: tuple[str, ...] = (), extra=()) -> Path:
    def tensors(stored):
        for name, tensor in stored.items():
            if name not in dropped:
                yield name, np.array(tensor.data), tensor.tensor_type
        yield from extra

    return rewritten_copy(files("f32"), path, tensors, values=values)


@pytest.mark.parametrize("case,fragment", [
    ("q_bias", "holds blk.0.attn_q.bias; llama.cpp's olmoe graph adds no attention biases"),
    ("tied", "has no output.weight, which llama.cpp's olmoe loader requires"),
    ("head_dim", "4 heads of 8 features do not make embedding_length 64"),
])
def test_files_llama_cpp_runs_differently_or_rejects_are_refused_in_one_line(case, fragment, files, tmp_path):
    bias = [(f"blk.{i}.attn_q.bias", np.zeros(64, dtype=np.float32), None) for i in range(2)]
    path = {
        "q_bias": lambda: _copy(files, tmp_path / "bias.gguf", extra=bias),
        "tied": lambda: _copy(files, tmp_path / "tied.gguf", dropped=("output.weight",)),
        "head_dim": lambda: _copy(files, tmp_path / "head.gguf", values={
            "olmoe.attention.key_length": 8, "olmoe.attention.value_length": 8, "olmoe.rope.dimension_count": 8}),
    }[case]()
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_fewer_key_heads_than_query_heads_are_refused(files, tmp_path):
    key = "olmoe.attention.head_count_kv"
    assert gguf.GGUFReader(files("f32")).fields[key].types == [gguf.GGUFValueType.UINT32]
    path = patched_metadata(files("f32"), tmp_path / "gqa.gguf", key, struct.pack("<I", 2))
    with pytest.raises(ModelLoadError, match=r"head_count_kv=2 differs from head_count=4; .* as many key heads"):
        load_hf_config(path)


def test_llm_runs_an_olmoe_gguf_file_like_its_directory(source, files):
    """The engine's own path (the cpu backend's runner, the file's vocabulary as tokenizer), not only the model."""
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for model in (source, files("f32")):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "hello"], params)])
    assert results[0] == results[1]
