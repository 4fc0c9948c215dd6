"""GPT-2 (`gpt2`) and StarCoder 1 (`starcoder`) GGUF files, written by flashllm's llama.cpp exporter from tiny
transformers GPT2LMHeadModel / GPTBigCodeForCausalLM directories, load as llama.cpp runs them: learned absolute
positions from `position_embd`, the fused attn_qkv [q | k | v] (one key / value head for StarCoder), GPT-2's Conv1D
weights transposed into linear layout by the converter, biased LayerNorms and projections, the tanh GELU, the head
tied to the embedding where the file has no output tensor."""

from __future__ import annotations

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
    exports,
    load_float_model,
    prompt_logits,
    rewritten_copy,
    round_trip_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
HIDDEN, HEAD_DIM = 64, 16  # the tiny presets'
CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The gpt2 preset (tied head, gelu_new), GPT-2 with its own head and another eps, the gpt_bigcode preset
    (multi-query, tied, a 96-wide MLP) and StarCoder with its own head."""
    root = tmp_path_factory.mktemp("gpt2")
    return {"gpt2": build_tiny_model(root / "gpt2", "gpt2", seed=3),
            "gpt2-untied": build_tiny_model(root / "gpt2-untied", "gpt2", seed=4, tie_word_embeddings=False,
                                            layer_norm_epsilon=1e-3, activation_function="gelu_pytorch_tanh"),
            "starcoder": build_tiny_model(root / "starcoder", "gpt_bigcode", seed=5),
            "starcoder-untied": build_tiny_model(root / "starcoder-untied", "gpt_bigcode", seed=6,
                                                 tie_word_embeddings=False, n_inner=None)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _metadata(reader, key: str):
    field = reader.fields[key]
    return field.parts[field.data[0]][0]


def _stored_and_source(sources, files, kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], object]:
    reader = gguf.GGUFReader(files(kind, "f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = {name: value.numpy() for name, value in load_file(str(sources[kind] / "model.safetensors")).items()}
    return stored, weights, reader


@pytest.mark.parametrize(("kind", "transposed"), [("gpt2", True), ("starcoder", False)])
def test_the_file_holds_the_converter_s_names_rows_and_metadata(kind, transposed, sources, files) -> None:
    stored, weights, reader = _stored_and_source(sources, files, kind)
    for part, name in (("attn_qkv.weight", "attn.c_attn.weight"), ("attn_output.weight", "attn.c_proj.weight"),
                       ("ffn_up.weight", "mlp.c_fc.weight"), ("ffn_down.weight", "mlp.c_proj.weight")):
        expected = weights[f"transformer.h.1.{name}"]  # GPT-2's Conv1D (in, out): the converter transposes it
        assert np.array_equal(stored[f"blk.1.{part}"], expected.T if transposed else expected), part
    for part, name in (("attn_qkv.bias", "attn.c_attn.bias"), ("attn_output.bias", "attn.c_proj.bias"),
                       ("ffn_up.bias", "mlp.c_fc.bias"), ("ffn_down.bias", "mlp.c_proj.bias"),
                       ("attn_norm.weight", "ln_1.weight"), ("attn_norm.bias", "ln_1.bias"),
                       ("ffn_norm.weight", "ln_2.weight"), ("ffn_norm.bias", "ln_2.bias")):
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"transformer.h.1.{name}"]), part
    for part, name in (("token_embd.weight", "transformer.wte.weight"), ("position_embd.weight", "transformer.wpe.weight"),
                       ("output_norm.bias", "transformer.ln_f.bias")):
        assert np.array_equal(stored[part], weights[name]), part
    assert "output.weight" not in stored  # tied: llama.cpp reads token_embd as the head
    assert not any(name.endswith(("attn.bias", "masked_bias")) for name in stored)
    arch = "gpt2" if kind == "gpt2" else "starcoder"
    assert reader.fields["general.architecture"].contents() == arch
    assert float(_metadata(reader, f"{arch}.attention.layer_norm_epsilon")) == pytest.approx(1e-5)
    assert int(_metadata(reader, f"{arch}.attention.head_count_kv")) == (4 if kind == "gpt2" else 1)
    assert int(_metadata(reader, f"{arch}.context_length")) == stored["position_embd.weight"].shape[0]
    assert stored["blk.1.attn_qkv.weight"].shape[0] == (3 * HIDDEN if kind == "gpt2" else HIDDEN + 2 * HEAD_DIM)


def test_an_untied_head_is_written_as_output(sources, files) -> None:
    for kind in ("gpt2-untied", "starcoder-untied"):
        stored, weights, _ = _stored_and_source(sources, files, kind)
        assert np.array_equal(stored["output.weight"], weights["lm_head.weight"]), kind


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-untied", "starcoder", "starcoder-untied"])
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == expected.architecture
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
                  "vocab_size"):
        assert getattr(ours, field) == getattr(expected, field), field
    # ggml's tanh GELU, under the family's default name whichever tanh name the directory used
    assert ours.hidden_act == ("gelu_new" if kind.startswith("gpt2") else "gelu_pytorch_tanh")
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32
    assert ours.raw.get("scale_attn_by_inverse_layer_idx", False) is False


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-untied", "starcoder", "starcoder-untied"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


@pytest.mark.parametrize("kind", ["gpt2", "starcoder"])
def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(kind, sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    """Q8_0 rounds the file's rows, the converter's (out, in) ones: GPT-2's Conv1D matrices, stored (in, out) in the
    directory, are rounded along their columns."""
    ours = prompt_logits(load_float_model(files(kind, "q8_0"), ops, model_registry), paged_driver, PROMPT)
    rounded = round_trip_copy(sources[kind], tmp_path / "rounded", lambda name: "Q8_0",
                              transposed=lambda name: kind == "gpt2" and name.endswith(CONV1D_WEIGHTS))
    expected = prompt_logits(load_float_model(rounded, ops, model_registry), paged_driver, PROMPT)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    unquantized = prompt_logits(load_float_model(sources[kind], ops, model_registry), paged_driver, PROMPT)
    assert (unquantized - ours).abs().max() > 1e-4, "the Q8_0 rounding did not change the logits"


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(files, monkeypatch, exact_w8_products) -> None:
    """Each rank takes its query heads' rows out of the fused multi-query attn_qkv, the one key / value head
    replicated, and the whole position table (fp32 activations, so that no rounding step blurs the comparison)."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("starcoder", "q8_0"))


def _without(*dropped: str):
    return lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items() if n not in dropped)


def _split_qkv(tensors):
    """Layer 0's attn_qkv as separate attn_q / attn_k / attn_v, which llama.cpp's gpt2 loader does not read."""
    for name, tensor in tensors.items():
        data = np.array(tensor.data)
        if name.startswith("blk.0.attn_qkv."):
            for index, part in enumerate(("attn_q", "attn_k", "attn_v")):
                yield name.replace("attn_qkv", part), np.ascontiguousarray(np.split(data, 3)[index]), None
        else:
            yield name, data, tensor.tensor_type


def _short_positions(tensors):
    for name, tensor in tensors.items():
        data = np.array(tensor.data)
        yield name, (np.ascontiguousarray(data[:100]) if name == "position_embd.weight" else data), tensor.tensor_type


@pytest.mark.parametrize(("kind", "tensors", "values", "dropped", "fragment"), [
    ("gpt2", _without("position_embd.weight"), None, (), "lacks position_embd.weight"),
    ("gpt2", _without("blk.0.attn_qkv.bias"), None, (), "lacks blk.0.attn_qkv.bias"),
    ("gpt2", _without("output_norm.bias"), None, (), "lacks output_norm.bias"),
    ("gpt2", _split_qkv, None, (), "lacks blk.0.attn_qkv.weight"),
    ("gpt2", _short_positions, None, (), "one row per position"),
    ("gpt2", _without(), None, ("gpt2.attention.layer_norm_epsilon",), "layer_norm_epsilon is None"),
    ("gpt2", _without(), {"gpt2.attention.head_count_kv": 1}, (), "no grouped-query or multi-query"),
    ("starcoder", _without(), {"starcoder.attention.head_count_kv": 2}, (), "no grouped-query attention"),
    ("starcoder", _without("blk.0.ffn_up.bias"), None, (), "lacks blk.0.ffn_up.bias"),
])
def test_a_file_llama_cpp_would_run_otherwise_is_refused(kind, tensors, values, dropped, fragment, files, tmp_path):
    broken = rewritten_copy(files(kind, "f32"), tmp_path / "broken.gguf", tensors, values=values, dropped=dropped)
    with pytest.raises(ModelLoadError, match=fragment):
        load_hf_config(broken)


@pytest.mark.parametrize(("preset", "changes", "fragment"), [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=false"),
    ("gpt2", {"activation_function": "relu"}, "tanh-approximated GELU"),
    ("gpt_bigcode", {"activation_function": "gelu"}, "tanh-approximated GELU"),
    ("gpt_bigcode", {"multi_query": False}, "multi_query=false"),
])
def test_what_llama_cpp_would_run_differently_has_no_export(preset, changes, fragment, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", preset, seed=1, **changes)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")
