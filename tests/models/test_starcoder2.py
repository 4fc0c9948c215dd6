"""StarCoder 2 (biased LayerNorms, an ungated GELU MLP, biases on every projection): config.json read as transformers'
Starcoder2Config reads it, tensor parallelism, and GGUF `starcoder2` files written by flashllm's llama.cpp exporter
loading as llama.cpp runs them. The tiny preset's paged-forward and engine parity with transformers (sliding window
included) run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config, parse_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("changes", [{}, {"use_bias": False, "norm_epsilon": 1e-3, "tie_word_embeddings": False},
                                     {"sliding_window": 32, "hidden_act": "gelu"}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import Starcoder2Config

    ours, theirs = parse_hf_config({**RAW, **changes}), Starcoder2Config(**{**RAW, **changes})
    assert ours.rms_norm_eps == theirs.norm_epsilon
    assert ours.attention_bias == ours.mlp_bias == theirs.use_bias
    assert (ours.tie_word_embeddings, ours.hidden_act) == (theirs.tie_word_embeddings, theirs.hidden_act)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.sliding_windows == (theirs.sliding_window,) * 2


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ({"use_bias": "yes"}, "use_bias='yes' must be true or false"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """The plain MLP's up projection splits by columns and its down projection by rows, biases added once."""
    model_dir = build_tiny_model(tmp_path / "starcoder2", "starcoder2", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # llama.cpp runs starcoder2 files with full attention: the exported source has no window
    return build_tiny_model(tmp_path_factory.mktemp("starcoder2"), "starcoder2", seed=3, sliding_window=None)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"starcoder2": source})
    return lambda file_type: get("starcoder2", file_type)


def test_the_file_holds_the_converter_s_names_and_eps(source, files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    for part, module in (("ffn_up.bias", "mlp.c_fc.bias"), ("ffn_down.weight", "mlp.c_proj.weight"),
                         ("attn_norm.bias", "input_layernorm.bias"), ("ffn_norm.bias", "post_attention_layernorm.bias")):
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"model.layers.1.{module}"].numpy()), part
    assert np.array_equal(stored["output_norm.bias"], weights["model.norm.bias"].numpy())
    assert "output.weight" not in stored  # tied
    field = reader.fields["starcoder2.attention.layer_norm_epsilon"]
    assert float(field.parts[field.data[0]][0]) == pytest.approx(1e-5)


def test_a_gguf_file_loads_the_directory_s_config(source, files) -> None:
    ours, expected = load_hf_config(files("f32")), load_hf_config(source)
    assert ours.architecture == "Starcoder2ForCausalLM"
    for field in ("hidden_act", "attention_bias", "mlp_bias", "num_key_value_heads", "tie_word_embeddings",
                  "sliding_windows", "vocab_size"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


@pytest.mark.parametrize(("changes", "fragment"), [({}, "sliding window"),
                                                   ({"sliding_window": None, "use_bias": False}, "use_bias=false")])
def test_what_llama_cpp_would_run_differently_has_no_export(changes, fragment, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "starcoder2", seed=1, tokenizer=False, **changes)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")
