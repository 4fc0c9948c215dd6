"""IBM Granite GGUF files (`granite`), written by flashllm's llama.cpp exporter from the tiny `granite` directory, load
into the directory's model: F32 exactly (up to the scales' float32 rounding), Q8_0 as the gguf package dequantizes
it. The four multipliers travel under llama.cpp's names and are read back as its graph applies them (an absent
attention scale is head_dim ** -0.5); metadata llama.cpp would refuse or run differently is refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import permute_for_llama_rope  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.gguf.granite import granite_config_fields  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_q8_0_logits,
    export_of,
    greedy_tokens,
    load_float_model,
    patched_metadata,
    prompt_logits,
)
from flashllm.testing.tiny_models import PRESETS, build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
MULTIPLIERS = PRESETS["granite"][1]  # embedding 12, residual 0.22, attention 0.0625, logits / 8
SCALE_KEYS = {"granite.embedding_scale": "embedding_multiplier", "granite.residual_scale": "residual_multiplier",
              "granite.attention.scale": "attention_multiplier", "granite.logit_scale": "logits_scaling"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("granite"), "granite", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    """"f32" | "q8_0" -> the exported GGUF file, written once."""
    return export_of(tmp_path_factory.mktemp("gguf"), "granite", source)


def test_the_file_holds_what_llama_cpp_s_converter_writes(source, files):
    reader = gguf.GGUFReader(files("f32"))
    assert reader.fields["general.architecture"].contents() == "granite"
    for key, field in SCALE_KEYS.items():
        assert reader.fields[key].contents() == pytest.approx(MULTIPLIERS[field], rel=1e-7), key
    weights = load_file(str(source / "model.safetensors"))
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    # Q and K rows in llama.cpp's interleaved order (GraniteModel is a LlamaModel), V as the checkpoint has it
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(stored["blk.1.attn_q.weight"], torch.from_numpy(permute_for_llama_rope(q.numpy(), 4)))
    assert not torch.equal(stored["blk.1.attn_q.weight"], q)
    assert torch.equal(stored["blk.1.attn_v.weight"], weights["model.layers.1.self_attn.v_proj.weight"])


def test_config_carries_the_four_multipliers(source, files):
    exact = ("head_dim", "rotary_dim", "num_key_value_heads", "tie_word_embeddings", "attention_bias", "mlp_bias",
             "rope_theta")
    multipliers = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    ours, _ = check_config_fields(files("f32"), source, exact, approx=multipliers, rel=1e-7)  # float32 in GGUF
    assert ours.architecture == "GraniteForCausalLM"


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    from transformers import AutoModelForCausalLM

    ours = load_float_model(files("f32"), ops, model_registry)
    reference = load_float_model(source, ops, model_registry)
    expected = prompt_logits(reference, paged_driver, PROMPT)
    torch.testing.assert_close(prompt_logits(ours, paged_driver, PROMPT), expected, rtol=0, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None)  # no stop: the greedy run below does not stop either
    assert greedy_tokens(ours, paged_driver, PROMPT, 8) == expected[0, len(PROMPT):].tolist()


def test_q8_0_gguf_equals_the_dequantized_float_model(source, files, ops, model_registry, paged_driver, tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    assert ours.model.layers[0].self_attn.qkv_proj.qweight.gguf_type == "Q8_0"  # the blocks kept as stored
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "float")


class _Metadata:
    """The part of a GGUFFile granite_config_fields reads: its name, metadata values and tensor names."""

    def __init__(self, **values) -> None:
        self.name, self.values, self.tensors = "model.gguf", values, {}

    def get(self, key: str, default=None):
        return self.values.get(key, default)


SHAPE = {"hidden_size": 2048, "num_attention_heads": 32}  # granite-3.x-2b: head_dim 64


def test_unset_scales_are_what_llama_cpp_s_graph_applies():
    """Absent or 0: no embedding or residual scaling (1), and the attention scale head_dim ** -0.5, not
    transformers' default 1.0 (a file written without `attention_multiplier`)."""
    fields = granite_config_fields(_Metadata(**{"granite.logit_scale": 8.0, "granite.residual_scale": 0.0}), SHAPE)
    assert (fields["embedding_multiplier"], fields["residual_multiplier"]) == (1.0, 1.0)
    assert (fields["attention_multiplier"], fields["logits_scaling"]) == (0.125, 8.0)


@pytest.mark.parametrize("values,fragment", [
    ({}, "has no positive granite.logit_scale, which llama.cpp requires"),
    ({"granite.logit_scale": 0.0}, "has no positive granite.logit_scale"),
    ({"granite.logit_scale": 8.0, "granite.embedding_scale": -12.0}, "granite.embedding_scale is -12.0; expected"),
    ({"granite.logit_scale": 8.0, "granite.attention.scale": "0.1"}, "granite.attention.scale is '0.1'"),
    ({"granite.logit_scale": 8.0, "granite.rope.scaling.finetuned": False}, "rope.scaling.finetuned is false"),
])
def test_metadata_llama_cpp_would_refuse_or_run_differently_is_refused(values, fragment):
    with pytest.raises(ModelLoadError) as err:
        granite_config_fields(_Metadata(**values), SHAPE)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,kind,value,fragment", [
    ("granite.logit_scale", gguf.GGUFValueType.FLOAT32, struct.pack("<f", -8.0), "logit_scale is -8.0; expected"),
    # partial rotary stays refused for granite (llama.cpp's graph asserts rope over the whole head)
    ("granite.rope.dimension_count", gguf.GGUFValueType.UINT32, struct.pack("<I", 12),
     "rope over 12 of 16 head features (partial rotary) is not supported"),
])
def test_an_inconsistent_file_is_refused_in_one_line(key, kind, value, fragment, files, tmp_path):
    assert gguf.GGUFReader(files("f32")).fields[key].types == [kind]
    path = patched_metadata(files("f32"), tmp_path / "bad.gguf", key, value)
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
