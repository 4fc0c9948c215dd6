"""Arcee (Llama's decoder with an ungated relu² MLP): config.json read as transformers' ArceeConfig reads it, tensor
parallelism, and GGUF `arcee` files written by flashllm's llama.cpp exporter loading as llama.cpp runs them (YaRN
included). The tiny preset's paged-forward and engine parity with transformers run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

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

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60, 4, 90, 31, 140, 2, 180, 66,
          19, 230, 47, 101, 8, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60, 5, 17, 99, 3, 250, 41, 8, 200, 77, 12,
          1, 202, 64, 33, 7, 210, 150, 9, 60, 4, 90, 31, 140, 2, 180, 66, 19, 230]  # past the original context (64)
RAW = {"architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("changes", [{}, {"hidden_act": "relu", "mlp_bias": True, "num_key_value_heads": 2}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import ArceeConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), ArceeConfig(**{**RAW, **changes})
    assert (ours.hidden_act, ours.mlp_bias, ours.rms_norm_eps) == (theirs.hidden_act, theirs.mlp_bias,
                                                                   theirs.rms_norm_eps)
    assert (ours.num_key_value_heads, ours.tie_word_embeddings) == (theirs.num_key_value_heads,
                                                                    theirs.tie_word_embeddings)
    assert ours.max_position_embeddings == theirs.max_position_embeddings


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "arcee", "arcee", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT[:19], [7, 3, 250]], model_dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("arcee"), "arcee", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"arcee": source})
    return lambda file_type: get("arcee", file_type)


def test_the_file_has_no_gate_and_says_yarn(files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    names = {t.name for t in reader.tensors}
    assert "blk.0.ffn_up.weight" in names and not any("ffn_gate" in name for name in names)
    field = reader.fields["arcee.rope.scaling.factor"]
    assert float(np.asarray(field.parts[field.data[0]])[0]) == 4.0
    config = load_hf_config(files("f32"))
    assert (config.architecture, config.hidden_act) == ("ArceeForCausalLM", "relu2")
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["factor"] == 4.0


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_a_sliding_window_has_no_export(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "arcee", seed=1, tokenizer=False, sliding_window=16)
    with pytest.raises(GGUFExportError, match="sliding window"):
        export_gguf(model_dir, tmp_path / "model.gguf")
