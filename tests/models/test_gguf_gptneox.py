"""GPT-NeoX GGUF files (`gptneox`: Pythia, GPT-NeoX-20B), written by flashllm's llama.cpp exporter from tiny
transformers GPTNeoXForCausalLM directories, load as llama.cpp runs them: the fused attn_qkv in the converter's
[all q | all k | all v] row order, the parallel or sequential residual as `use_parallel_residual` says, RoPE over
`rope.dimension_count` features of each head, biased LayerNorms and projections, the tanh-approximated GELU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
HEADS, HEAD_DIM = 4, 16  # the tiny preset's


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Pythia's parallel residual over a quarter-head RoPE, and the sequential block over half of each head; GELU as
    llama.cpp runs it (tanh), so that the files run exactly as their directories."""
    root = tmp_path_factory.mktemp("gptneox")
    return {"parallel": build_tiny_model(root / "parallel", "gpt_neox", seed=3, hidden_act="gelu_pytorch_tanh"),
            "sequential": build_tiny_model(root / "sequential", "gpt_neox", seed=4, hidden_act="gelu_new",
                                           use_parallel_residual=False, rotary_pct=0.5, layer_norm_eps=1e-3)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _metadata(reader, key: str):
    field = reader.fields[key]
    return field.parts[field.data[0]][0]


def test_the_file_holds_the_converter_s_names_rows_and_metadata(sources, files) -> None:
    reader = gguf.GGUFReader(files("parallel", "f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = {name: value.numpy() for name, value in load_file(str(sources["parallel"] / "model.safetensors")).items()}
    for kind in ("weight", "bias"):  # checkpoint rows per head: q, k, v; the file's: every q, every k, every v
        fused = weights[f"gpt_neox.layers.1.attention.query_key_value.{kind}"]
        expected = [fused[h * 3 * HEAD_DIM + part * HEAD_DIM:h * 3 * HEAD_DIM + (part + 1) * HEAD_DIM]
                    for part in range(3) for h in range(HEADS)]
        assert np.array_equal(stored[f"blk.1.attn_qkv.{kind}"], np.concatenate(expected)), kind
    for part, name in (("attn_output.bias", "attention.dense.bias"), ("ffn_up.weight", "mlp.dense_h_to_4h.weight"),
                       ("ffn_down.bias", "mlp.dense_4h_to_h.bias"), ("attn_norm.bias", "input_layernorm.bias"),
                       ("ffn_norm.weight", "post_attention_layernorm.weight")):
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"gpt_neox.layers.1.{name}"]), part
    for part, name in (("token_embd.weight", "gpt_neox.embed_in.weight"), ("output.weight", "embed_out.weight"),
                       ("output_norm.bias", "gpt_neox.final_layer_norm.bias")):
        assert np.array_equal(stored[part], weights[name]), part
    assert "blk.0.attn_q.weight" not in stored
    assert float(_metadata(reader, "gptneox.attention.layer_norm_epsilon")) == pytest.approx(1e-5)
    assert int(_metadata(reader, "gptneox.rope.dimension_count")) == 4
    assert bool(_metadata(reader, "gptneox.use_parallel_residual"))
    sequential = gguf.GGUFReader(files("sequential", "f32"))
    assert not bool(_metadata(sequential, "gptneox.use_parallel_residual"))
    assert int(_metadata(sequential, "gptneox.rope.dimension_count")) == 8


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == "GPTNeoXForCausalLM"
    for field in ("rotary_dim", "rope_theta", "num_key_value_heads", "tie_word_embeddings", "attention_bias",
                  "mlp_bias", "vocab_size", "intermediate_size", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.raw["use_parallel_residual"] == expected.raw["use_parallel_residual"]
    assert ours.hidden_act == "gelu_pytorch_tanh"  # ggml's GELU, whichever tanh name the directory used
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("parallel", "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources["parallel"], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_an_exact_gelu_checkpoint_runs_with_llama_cpp_s_tanh_gelu(ops, model_registry, paged_driver, tmp_path):
    """Pythia's config says "gelu" (erf); its file runs ggml's tanh approximation, as llama.cpp does: the logits of
    the directory with hidden_act gelu_pytorch_tanh, not the directory's own."""
    source = build_tiny_model(tmp_path / "gelu", "gpt_neox", seed=5)
    assert load_hf_config(source).hidden_act == "gelu"
    tanh = shutil.copytree(source, tmp_path / "tanh")
    config = json.loads((tanh / "config.json").read_text())
    (tanh / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_pytorch_tanh"}))
    ours = prompt_logits(load_float_model(export_gguf(source, tmp_path / "gelu.gguf"), ops, model_registry),
                         paged_driver, PROMPT)
    torch.testing.assert_close(ours, prompt_logits(load_float_model(tanh, ops, model_registry), paged_driver, PROMPT),
                               rtol=0, atol=1e-5)
    exact = prompt_logits(load_float_model(source, ops, model_registry), paged_driver, PROMPT)
    assert (ours - exact).abs().max() > 1e-6


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(files, monkeypatch, exact_w8_products) -> None:
    """Each rank takes its heads' rows out of every part of the fused attn_qkv Q8_0 blocks (fp32 activations, so
    that no rounding step blurs the comparison)."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("parallel", "q8_0"))


def _without(*dropped: str):
    return lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items() if n not in dropped)


def _split_qkv(tensors):
    """Layer 0's attn_qkv as separate attn_q / attn_k / attn_v, which llama.cpp's gptneox loader does not read."""
    for name, tensor in tensors.items():
        data = np.array(tensor.data)
        if name.startswith("blk.0.attn_qkv."):
            for index, part in enumerate(("attn_q", "attn_k", "attn_v")):
                yield name.replace("attn_qkv", part), np.ascontiguousarray(np.split(data, 3)[index]), None
        else:
            yield name, data, tensor.tensor_type


@pytest.mark.parametrize(("tensors", "values", "dropped", "fragment"), [
    (_without("output.weight"), None, (), "lacks output.weight"),
    (_without("blk.0.attn_qkv.bias"), None, (), "lacks blk.0.attn_qkv.bias"),
    (_split_qkv, None, (), "lacks blk.0.attn_qkv.weight"),
    (_without(), None, ("gptneox.use_parallel_residual",), "use_parallel_residual is None"),
    (_without(), None, ("gptneox.attention.layer_norm_epsilon",), "layer_norm_epsilon is None"),
    (_without(), {"gptneox.attention.head_count_kv": 2}, (), "no grouped-query attention"),
    (_without(), {"gptneox.rope.dimension_count": 5}, (), "dimension_count is 5"),
])
def test_a_file_llama_cpp_would_run_otherwise_is_refused(tensors, values, dropped, fragment, files, tmp_path):
    broken = rewritten_copy(files("parallel", "f32"), tmp_path / "broken.gguf", tensors, values=values,
                            dropped=dropped)
    with pytest.raises(ModelLoadError, match=fragment):
        load_hf_config(broken)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"attention_bias": False}, "attention_bias=false"), ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"hidden_act": "relu"}, "always runs GELU"),
])
def test_what_llama_cpp_would_run_differently_has_no_export(changes, fragment, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "gpt_neox", seed=1, **changes)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")
