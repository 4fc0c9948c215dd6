"""Gemma 3 text GGUF files (`gemma3`), written by flashllm's llama.cpp exporter from a tiny directory, load into the
directory's model: F32 exactly, Q8_0 as the gguf package dequantizes it. What GGUF does not store (which layers slide,
the sliding layers' RoPE base, the attention scale) is derived by llama.cpp's rules, and configs or files those rules
would run differently are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.gguf.gemma3 import attention_scalar, gemma3_config_fields  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_q8_0_logits,
    export_of,
    greedy_tokens,
    load_float_model,
    prompt_logits,
)
from flashllm.testing.tiny_models import PRESETS, build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]  # longer than the window (8)
# The tiny preset (4 layers alternating, query_pre_attn_scalar 24) cannot be written as GGUF: llama.cpp slides layer
# i when i % 6 < 5 and scales by head_dim ** -0.5. This shape follows those rules: layers 0-4 and 6 slide, 5 does
# not; its full layers keep the preset's linear RoPE scaling, its sliding layers the local base 10000.
LLAMA_CPP_SHAPE = {"num_hidden_layers": 7, "sliding_window_pattern": 6, "query_pre_attn_scalar": 32}
SLIDING = (True, True, True, True, True, False, True)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", seed=3, **LLAMA_CPP_SHAPE)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    """"f32" | "q8_0" -> the exported GGUF file, written once."""
    return export_of(tmp_path_factory.mktemp("gguf"), "gemma3", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files):
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert reader.fields["gemma3.attention.sliding_window"].contents() == 8
    weights = load_file(str(source / "model.safetensors"))
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    # Gemma's norms as 1 + w, under llama.cpp's names (ffn_norm is the pre-feedforward norm in gemma3)
    for hf, name in (("pre_feedforward_layernorm", "ffn_norm"), ("post_attention_layernorm", "post_attention_norm"),
                     ("post_feedforward_layernorm", "post_ffw_norm"), ("self_attn.q_norm", "attn_q_norm")):
        torch.testing.assert_close(stored[f"blk.2.{name}.weight"], weights[f"model.layers.2.{hf}.weight"] + 1,
                                   rtol=0, atol=0)
    # Q and K rows as the checkpoint has them: gemma3 runs half-split (NEOX) rotary in llama.cpp
    assert torch.equal(stored["blk.1.attn_q.weight"], weights["model.layers.1.self_attn.q_proj.weight"])


def test_config_follows_llama_cpp_s_gemma3_rules(source, files):
    fields = ("architecture", "sliding_windows", "query_pre_attn_scalar", "local_rope_theta", "local_rope_scaling",
              "rope_theta", "rope_scaling", "head_dim", "final_logit_softcapping", "gelu_approximate",
              "tie_word_embeddings", "num_key_value_heads", "qk_norm")
    ours, _ = check_config_fields(files("f32"), source, fields, rel=1e-7)  # GGUF stores rms_norm_eps as float32
    assert tuple(w is not None for w in ours.sliding_windows) == SLIDING


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    from transformers import AutoModelForCausalLM

    ours = load_float_model(files("f32"), ops, model_registry)
    reference = load_float_model(source, ops, model_registry)
    expected = prompt_logits(reference, paged_driver, PROMPT)
    torch.testing.assert_close(prompt_logits(ours, paged_driver, PROMPT), expected,
                               rtol=0, atol=1e-6)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert greedy_tokens(ours, paged_driver, PROMPT, 8) == expected[0, len(PROMPT):].tolist()


def test_q8_0_gguf_equals_the_dequantized_float_model(source, files, ops, model_registry, paged_driver, tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    assert ours.model.layers[0].self_attn.qkv_proj.qweight.gguf_type == "Q8_0"  # the blocks kept as stored
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "float")


def test_a_file_without_a_sliding_window_attends_to_everything(source, tmp_path, ops, model_registry, paged_driver):
    """sliding_window_pattern 1 (no layer slides): the converter writes no window, llama.cpp runs every layer full."""
    shutil.copytree(source, tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config.update(sliding_window_pattern=1, layer_types=["full_attention"] * 7)
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    path = export_gguf(tmp_path / "full", tmp_path / "full.gguf", "f32")
    assert "gemma3.attention.sliding_window" not in gguf.GGUFReader(path).fields
    assert load_hf_config(path).sliding_windows == (None,) * 7
    logits = [prompt_logits(load_float_model(m, ops, model_registry), paged_driver, PROMPT)
              for m in (path, tmp_path / "full")]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides,fragment", [
    ({}, "sliding layers [0, 2] of 4: llama.cpp's gemma3 slides layer i when i % 6 < 5"),  # the tiny preset itself
    ({**LLAMA_CPP_SHAPE, "query_pre_attn_scalar": 24}, "query_pre_attn_scalar=24: llama.cpp's gemma3 derives 32"),
    ({**LLAMA_CPP_SHAPE, "rope_local_base_freq": 20000.0}, "sliding layers' RoPE base 20000"),
    ({**LLAMA_CPP_SHAPE, "final_logit_softcapping": 30.0}, "final_logit_softcapping with sliding layers"),
])
def test_the_exporter_refuses_what_llama_cpp_would_run_differently(overrides, fragment, source, tmp_path):
    config = json.loads((source / "config.json").read_text())
    config.update({**PRESETS["gemma3"][1], **overrides})
    for derived in ("layer_types", "rope_parameters"):  # read from sliding_window_pattern and rope_* again
        config.pop(derived, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFExportError) as err:
        export_gguf(tmp_path, tmp_path / "out.gguf", "f32")
    assert fragment in str(err.value) and "\n" not in str(err.value)


class _Metadata:
    """The part of a GGUFFile gemma3_config_fields reads: its name and metadata values."""

    def __init__(self, **values) -> None:
        self.name, self.values = "model.gguf", values

    def get(self, key: str, default=None):
        return self.values.get(key, default)


SHAPE = {"num_hidden_layers": 26, "hidden_size": 1152, "num_attention_heads": 4, "head_dim": 256}  # gemma-3-1b


@pytest.mark.parametrize("values,fragment", [
    ({"gemma3.attention.sliding_window": 512, "gemma3.final_logit_softcapping": 30.0},
     "final_logit_softcapping with sliding-window layers"),
    ({"gemma3.attention.sliding_window": -1}, "sliding_window is -1; expected a whole number"),
    ({"gemma3.attention.sliding_window": "512"}, "sliding_window is '512'"),
    ({"gemma3.final_logit_softcapping": 0.0}, "final_logit_softcapping is 0.0; expected a positive number"),
])
def test_metadata_llama_cpp_would_run_differently_is_refused(values, fragment):
    with pytest.raises(ModelLoadError) as err:
        gemma3_config_fields(_Metadata(**values), SHAPE)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_layer_pattern_and_the_attention_scale_are_llama_cpp_s():
    fields = gemma3_config_fields(_Metadata(**{"gemma3.attention.sliding_window": 512}), SHAPE)
    assert [i for i, t in enumerate(fields["layer_types"]) if t == "full_attention"] == [5, 11, 17, 23]
    assert (fields["sliding_window"], fields["query_pre_attn_scalar"], fields["rope_local_base_freq"]) == (512, 256, 1e4)
    # without a window every layer is full, and a cap (then applied by llama.cpp's graph) is kept
    full = gemma3_config_fields(_Metadata(**{"gemma3.final_logit_softcapping": 30.0}), SHAPE)
    assert set(full["layer_types"]) == {"full_attention"} and full["final_logit_softcapping"] == 30.0
    # gemma-3-27b: 62 layers, hidden 5376 over 32 heads of 128 -> 168, not head_dim
    assert attention_scalar(62, 5376, 32, 128) == 168 and attention_scalar(34, 2560, 8, 256) == 256
