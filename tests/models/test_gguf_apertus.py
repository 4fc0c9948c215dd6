"""Apertus GGUF files (`apertus`), written by flashllm's llama.cpp exporter from tiny transformers ApertusForCausalLM
directories (per-head q / k RMSNorms, the ungated xIELU MLP with its scalars redrawn per layer; llama3 RoPE, or plain),
load into the directory's model: the converter's names and metadata (the xIELU scalars as per-layer metadata arrays,
llama3 as rope_freqs), the directory's configuration, F32 logits equal to the directory's and greedy tokens equal to
transformers', Q8_0 as the directory rounded through Q8_0; what llama.cpp's apertus graph would run differently (or
not load) is refused, in export and in loading."""

from __future__ import annotations

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
    edited_copy,
    exports,
    load_float_model,
    prompt_logits,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# Apertus' published llama3 settings (the rope_freqs loader knows these), base 500000 so head_dim 16's frequencies
# fall in all three llama3 bands
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIG_FIELDS = ("architecture", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                 "intermediate_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings", "qk_norm",
                 "attention_bias", "rope_theta", "hidden_act")
SCALARS = ("alpha_p", "alpha_n", "beta", "eps")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("apertus")
    return {"llama3": build_tiny_model(root / "llama3", "apertus", seed=3, rope_parameters=LLAMA3,
                                       max_position_embeddings=16384),
            "plain": build_tiny_model(root / "plain", "apertus", seed=4,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def test_the_file_holds_what_llama_cpp_s_converter_writes(sources, files) -> None:
    reader = gguf.GGUFReader(files("llama3", "f32"))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = {n: v.float().numpy() for n, v in load_file(str(sources["llama3"] / "model.safetensors")).items()}
    assert fields["general.architecture"] == "apertus"
    for scalar in SCALARS:  # metadata arrays, one value per layer, no arch prefix; no such tensors
        expected = [float(weights[f"model.layers.{i}.mlp.act_fn.{scalar}"].reshape(-1)[0]) for i in range(2)]
        assert fields[f"xielu.{scalar}"] == pytest.approx(expected, rel=1e-6), scalar
    assert fields["xielu.alpha_p"][0] != pytest.approx(fields["xielu.alpha_p"][1])  # redrawn per layer
    assert not any("act_fn" in name or "ffn_gate" in name for name in stored)
    assert np.array_equal(stored["blk.1.attn_norm.weight"], weights["model.layers.1.attention_layernorm.weight"])
    assert np.array_equal(stored["blk.1.ffn_norm.weight"], weights["model.layers.1.feedforward_layernorm.weight"])
    for part in ("q", "k"):  # unpermuted, per-head norms head_dim wide
        assert np.array_equal(stored[f"blk.1.attn_{part}.weight"], weights[f"model.layers.1.self_attn.{part}_proj.weight"])
        assert stored[f"blk.1.attn_{part}_norm.weight"].shape == (16,)
    assert stored["rope_freqs.weight"].shape == (8,) and "output.weight" in stored
    assert "rope_freqs.weight" not in {t.name for t in gguf.GGUFReader(files("plain", "f32")).tensors}


@pytest.mark.parametrize("kind", ["llama3", "plain"])
def test_config_is_the_directory_s(kind, sources, files) -> None:
    check_config_fields(files(kind, "f32"), sources[kind], CONFIG_FIELDS, approx=("rope_scaling", "rms_norm_eps"))


@pytest.mark.parametrize("kind", ["llama3", "plain"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                               paged_driver) -> None:
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path) -> None:
    check_q8_0_file(files("llama3", "q8_0"), sources["llama3"], ops, model_registry, paged_driver, PROMPT,
                    tmp_path / "rounded", {"blk.1.attn_q.weight": "Q8_0", "blk.1.ffn_up.weight": "Q8_0"})


def test_one_value_stands_for_every_layer(files, ops, model_registry, paged_driver, tmp_path) -> None:
    """llama.cpp's get_key_or_arr reads one number as every layer's value."""
    path = _copy(files, tmp_path / "one.gguf", values={"xielu.beta": 0.25}, dropped=("xielu.beta",))
    assert load_hf_config(path).raw["xielu_beta"] == [0.25, 0.25]
    model = load_float_model(path, ops, model_registry)
    assert [float(layer.mlp.act_fn.beta) for layer in model.model.layers] == [0.25, 0.25]
    before = prompt_logits(load_float_model(files("llama3", "f32"), ops, model_registry), paged_driver, PROMPT)
    assert not torch.allclose(prompt_logits(model, paged_driver, PROMPT), before)


@pytest.mark.parametrize("overrides,fragment", [
    ({"attention_bias": True}, "its apertus graph adds no q / k / v biases"),
    ({"tie_word_embeddings": True}, "its apertus loader requires output.weight"),
])
def test_what_llama_cpp_would_run_differently_is_not_exported(overrides, fragment, tmp_path) -> None:
    source = build_tiny_model(tmp_path / "model", "apertus", seed=1, **overrides)
    with pytest.raises(GGUFExportError, match="Apertus with") as err:
        export_gguf(source, tmp_path / "out.gguf")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def _copy(files, path: Path, **edits) -> Path:
    return edited_copy(files("llama3", "f32"), path, **edits)


def _zeros(part: str, width: int) -> list:
    return [(f"blk.{i}.{part}", np.zeros(width, dtype=np.float32), None) for i in range(2)]


@pytest.mark.parametrize("case,fragment", [
    ("tied", "lacks output.weight, which llama.cpp's apertus loader requires"),
    ("o_bias", "holds blk.0.attn_output.bias, which llama.cpp's apertus graph never reads"),
    ("gate", "holds blk.0.ffn_gate.weight, which llama.cpp's apertus graph never reads"),
    ("no_eps", "xielu.eps is None; llama.cpp's apertus loader requires one number or 2 (one per layer)"),
    ("three", "xielu.alpha_n is an array of 3; llama.cpp's apertus loader requires one number or 2"),
])
def test_files_llama_cpp_runs_differently_or_rejects_are_refused_in_one_line(case, fragment, files, tmp_path) -> None:
    path = {
        "tied": lambda: _copy(files, tmp_path / "tied.gguf", left_out=("output.weight",)),
        "o_bias": lambda: _copy(files, tmp_path / "bias.gguf", extra=_zeros("attn_output.bias", 64)),
        "gate": lambda: _copy(files, tmp_path / "gate.gguf", extra=[
            (f"blk.{i}.ffn_gate.weight", np.zeros((128, 64), dtype=np.float32), None) for i in range(2)]),
        "no_eps": lambda: _copy(files, tmp_path / "eps.gguf", dropped=("xielu.eps",)),
        "three": lambda: _copy(files, tmp_path / "three.gguf", values={"xielu.alpha_n": [0.1, 0.2, 0.3]}),
    }[case]()
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
