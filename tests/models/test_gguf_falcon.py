"""Falcon GGUF files (`falcon`: Falcon-7B / 40B / 180B, Falcon2-11B), written by flashllm's llama.cpp exporter from
tiny transformers FalconForCausalLM directories, load as llama.cpp runs them: the fused attn_qkv in the converter's
[all q | all k | all v] row order, 40B's ln_mlp / ln_attn as attn_norm / attn_norm_2 or one attn_norm, the key / value
heads from head_count_kv, biased LayerNorms, unbiased projections, the tanh-approximated GELU, a tied head."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
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
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16  # the tiny preset's
TANH = {"activation": "gelu_pytorch_tanh"}  # GELU as llama.cpp runs it, so that the files run exactly as their sources


def _without_kv_heads(model_dir: Path) -> Path:
    """The directory with num_kv_heads left out of config.json, as Falcon-7B's is (FalconConfig writes it back as the
    query heads, which the converter would read as key / value heads)."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("num_kv_heads")
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """40B's two norms over 2 key / value groups, 7B's multi-query layout with one norm, Falcon2-11B's new decoder
    architecture with one norm and a RoPE base of its own."""
    root = tmp_path_factory.mktemp("falcon")
    return {"two_norms": build_tiny_model(root / "two_norms", "falcon", seed=3, **TANH),
            "multi_query": _without_kv_heads(build_tiny_model(root / "multi_query", "falcon", seed=4,
                                                              new_decoder_architecture=False, multi_query=True,
                                                              layer_norm_epsilon=1e-3, **TANH)),
            "one_norm": build_tiny_model(root / "one_norm", "falcon", seed=5, num_ln_in_parallel_attn=1,
                                         rope_theta=500042.0, **TANH)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _metadata(reader, key: str):
    field = reader.fields[key]
    return field.parts[field.data[0]][0]


def test_the_file_holds_the_converter_s_names_rows_and_metadata(sources, files) -> None:
    reader = gguf.GGUFReader(files("two_norms", "f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = {name: value.numpy() for name, value in load_file(str(sources["two_norms"] / "model.safetensors")).items()}
    fused = weights["transformer.h.1.self_attention.query_key_value.weight"]
    group = HEADS // KV_HEADS  # checkpoint rows per group: its q heads, k, v; the file's: every q, every k, every v
    per_group = [[fused[(g * (group + 2) + h) * HEAD_DIM:(g * (group + 2) + h + 1) * HEAD_DIM]
                  for h in range(group + 2)] for g in range(KV_HEADS)]
    expected = ([head for g in range(KV_HEADS) for head in per_group[g][:group]]
                + [per_group[g][group] for g in range(KV_HEADS)] + [per_group[g][group + 1] for g in range(KV_HEADS)])
    assert np.array_equal(stored["blk.1.attn_qkv.weight"], np.concatenate(expected))
    for part, name in (("attn_output.weight", "self_attention.dense.weight"),
                       ("ffn_up.weight", "mlp.dense_h_to_4h.weight"), ("ffn_down.weight", "mlp.dense_4h_to_h.weight"),
                       ("attn_norm.weight", "ln_mlp.weight"), ("attn_norm.bias", "ln_mlp.bias"),
                       ("attn_norm_2.weight", "ln_attn.weight"), ("attn_norm_2.bias", "ln_attn.bias")):
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"transformer.h.1.{name}"]), part
    for part, name in (("token_embd.weight", "transformer.word_embeddings.weight"),
                       ("output_norm.bias", "transformer.ln_f.bias")):
        assert np.array_equal(stored[part], weights[name]), part
    assert "output.weight" not in stored and "blk.0.attn_qkv.bias" not in stored
    assert float(_metadata(reader, "falcon.attention.layer_norm_epsilon")) == pytest.approx(1e-5)
    assert int(_metadata(reader, "falcon.attention.head_count_kv")) == KV_HEADS
    multi_query = gguf.GGUFReader(files("multi_query", "f32"))
    assert int(_metadata(multi_query, "falcon.attention.head_count_kv")) == 1
    assert {"blk.0.attn_norm.weight"} <= {t.name for t in multi_query.tensors}
    assert "blk.0.attn_norm_2.weight" not in {t.name for t in multi_query.tensors}


@pytest.mark.parametrize("kind", ["two_norms", "multi_query", "one_norm"])
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == "FalconForCausalLM"
    for field in ("num_key_value_heads", "num_ln_in_parallel_attn", "parallel_attn", "alibi", "rope_theta",
                  "tie_word_embeddings", "attention_bias", "mlp_bias", "vocab_size", "intermediate_size", "head_dim",
                  "hidden_act"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


@pytest.mark.parametrize("kind", ["two_norms", "multi_query", "one_norm"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("two_norms", "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources["two_norms"], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_an_exact_gelu_checkpoint_runs_with_llama_cpp_s_tanh_gelu(tmp_path) -> None:
    """Falcon's default activation "gelu" (erf) exports as the converter writes it; its file runs ggml's tanh GELU."""
    source = build_tiny_model(tmp_path / "gelu", "falcon", seed=6)
    assert load_hf_config(source).hidden_act == "gelu"
    assert load_hf_config(export_gguf(source, tmp_path / "gelu.gguf")).hidden_act == "gelu_pytorch_tanh"


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(files, monkeypatch, exact_w8_products) -> None:
    """Each rank takes its heads' rows out of every part of the fused attn_qkv Q8_0 blocks (fp32 activations)."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("two_norms", "q8_0"))


def _without(*dropped: str):
    return lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items() if n not in dropped)


def _with_qkv_bias(tensors):
    """Layer 0's attn_qkv with a bias, which llama.cpp's falcon loader does not read."""
    for name, tensor in tensors.items():
        yield name, np.array(tensor.data), tensor.tensor_type
        if name == "blk.0.attn_qkv.weight":
            yield "blk.0.attn_qkv.bias", np.zeros((HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=np.float32), None


@pytest.mark.parametrize(("tensors", "values", "dropped", "fragment"), [
    (_without("blk.0.attn_qkv.weight"), None, (), "lacks blk.0.attn_qkv.weight"),
    (_without("output_norm.bias"), None, (), "lacks output_norm.bias"),
    (_without("blk.0.attn_norm_2.bias"), None, (), "only one of"),
    (_with_qkv_bias, None, (), "holds blk.0.attn_qkv.bias"),
    (_without(), None, ("falcon.attention.layer_norm_epsilon",), "layer_norm_epsilon is None"),
    (_without(), {"falcon.rope.dimension_count": 8}, (), "partial rotary"),
])
def test_a_file_llama_cpp_would_run_otherwise_is_refused(tensors, values, dropped, fragment, files, tmp_path):
    broken = rewritten_copy(files("two_norms", "f32"), tmp_path / "broken.gguf", tensors, values=values,
                            dropped=dropped)
    with pytest.raises(ModelLoadError, match=fragment):
        load_hf_config(broken)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"alibi": True}, "always runs RoPE"),
    ({"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": None, "parallel_attn": False},
     "parallel_attn=false"),
    ({"bias": True}, "reads no biases"), ({"activation": "relu"}, "always runs GELU"),
    ({"ffn_hidden_size": 128}, "4 x hidden_size"), ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                                    "rope scaling"),
])
def test_what_llama_cpp_would_run_differently_has_no_export(changes, fragment, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "falcon", seed=1, **changes)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")


def test_key_value_heads_the_converter_reads_otherwise_have_no_export(tmp_path) -> None:
    """40B's layout without num_kv_heads in config.json: transformers takes one key / value head per query head, the
    converter one in all."""
    model_dir = _without_kv_heads(build_tiny_model(tmp_path / "model", "falcon", seed=1, num_kv_heads=4))
    fragment = "converter reads 1"
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")
