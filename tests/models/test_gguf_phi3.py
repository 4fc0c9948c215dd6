"""Phi-3 GGUF files (`phi3`), written by flashllm's llama.cpp exporter from the tiny `phi3` (sliding window) and
`phi3-longrope` (LongRoPE past 64 tokens, RoPE over 12 of 16 head features) directories, load into the directory's
model: F32 exactly (up to float32 metadata), Q8_0 as the gguf package dequantizes it, with the fused `attn_qkv` and
`ffn_up` cut into q / k / v and gate / up along whole rows (their blocks kept as stored). Files whose LongRoPE or
rotary metadata do not fit together are refused in one line."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.models.phi3 import LongRopeStack  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_q8_0_logits,
    exports,
    greedy_tokens,
    load_float_model,
    patched_metadata,
    prompt_logits,
)
from flashllm.testing.tiny_models import PRESETS, build_tiny_model  # noqa: E402

SHORT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
LONG = [(7 * i + 3) % 300 for i in range(80)]  # past phi3-longrope's original 64 tokens: the long factor set
ORIGINAL = 64
FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return {preset: build_tiny_model(tmp_path_factory.mktemp(preset), preset, seed=3)
            for preset in ("phi3", "phi3-longrope")}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    """(preset, "f32" | "q8_0") -> the exported GGUF file, written once."""
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def test_the_file_holds_what_llama_cpp_s_converter_writes(sources, files):
    reader = gguf.GGUFReader(files("phi3-longrope", "f32"))
    fields = {k: reader.fields[f"phi3.{k}"].contents() for k in (
        "rope.dimension_count", "rope.scaling.original_context_length", "attention.sliding_window", "context_length")}
    assert fields == {"rope.dimension_count": 12, "rope.scaling.original_context_length": ORIGINAL,
                      "attention.sliding_window": 0, "context_length": 512}
    # sqrt(1 + ln(512 / 64) / ln(64)), the converter's LongRoPE attention factor
    assert reader.fields["phi3.rope.scaling.attn_factor"].contents() == pytest.approx(1.5 ** 0.5, rel=1e-7)
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    scaling = PRESETS["phi3-longrope"][1]["rope_scaling"]
    assert stored["rope_factors_long.weight"].tolist() == pytest.approx(scaling["long_factor"], rel=1e-7)
    assert stored["rope_factors_short.weight"].tolist() == pytest.approx(scaling["short_factor"], rel=1e-7)
    # the fused projections as the checkpoint stores them: q, k, v rows and gate, up rows, not reordered (NEOX)
    weights = load_file(str(sources["phi3-longrope"] / "model.safetensors"))
    for name, module in FUSED.items():
        assert torch.equal(stored[f"blk.1.{name}.weight"], weights[f"model.layers.1.{module}.weight"])
    assert gguf.GGUFReader(files("phi3", "f32")).fields["phi3.attention.sliding_window"].contents() == 48


@pytest.mark.parametrize("preset", ["phi3", "phi3-longrope"])
def test_config_is_the_directory_s(preset, sources, files):
    ours, expected = load_hf_config(files(preset, "f32")), load_hf_config(sources[preset])
    for field in ("architecture", "head_dim", "rotary_dim", "sliding_windows", "max_position_embeddings",
                  "num_key_value_heads", "intermediate_size", "rope_theta", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(expected, field), field
    if preset == "phi3-longrope":
        assert ours.rope_scaling["original_max_position_embeddings"] == ORIGINAL
        assert ours.rope_scaling["attention_factor"] == pytest.approx(1.5 ** 0.5, rel=1e-7)
    else:
        assert ours.rope_scaling is None


@pytest.mark.parametrize("preset,prompt", [("phi3", SHORT), ("phi3-longrope", SHORT), ("phi3-longrope", LONG)])
def test_f32_gguf_equals_its_source_directory_and_transformers(preset, prompt, sources, files, ops, model_registry,
                                                                paged_driver):
    """The long prompt (80 > 64 tokens) runs on the long factor set from position 0, the short one on the short."""
    from transformers import AutoModelForCausalLM

    ours = load_float_model(files(preset, "f32"), ops, model_registry)
    assert isinstance(ours.model, LongRopeStack) == (preset == "phi3-longrope")
    reference = load_float_model(sources[preset], ops, model_registry)
    expected = prompt_logits(reference, paged_driver, prompt)
    torch.testing.assert_close(prompt_logits(ours, paged_driver, prompt), expected,
                               rtol=0, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(sources[preset], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None)  # no stop: the greedy run below does not stop either
    assert greedy_tokens(ours, paged_driver, prompt, 8) == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset", ["phi3", "phi3-longrope"])
def test_q8_0_gguf_equals_the_dequantized_float_model(preset, sources, files, ops, model_registry, paged_driver,
                                                      tmp_path):
    ours = load_float_model(files(preset, "q8_0"), ops, model_registry)
    layer = ours.model.layers[0]
    # the fused tensors' parts joined again as the blocks stored
    assert layer.self_attn.qkv_proj.qweight.gguf_type == layer.mlp.gate_up_proj.qweight.gguf_type == "Q8_0"
    prompt = LONG if preset == "phi3-longrope" else SHORT
    check_q8_0_logits(ours, sources[preset], ops, model_registry, paged_driver, prompt, tmp_path / "float")


def test_tensor_parallel_ranks_hold_their_rows_of_each_fused_part(sources, files, ops, model_registry):
    for rank in (0, 1):
        kwargs = {"tp_rank": rank, "tp_size": 2}
        ours = dict(load_float_model(files("phi3-longrope", "f32"), ops, model_registry, **kwargs).named_parameters())
        reference = dict(load_float_model(sources["phi3-longrope"], ops, model_registry, **kwargs).named_parameters())
        assert ours.keys() == reference.keys()
        for name, param in reference.items():
            assert torch.equal(ours[name], param), name


@pytest.mark.parametrize("key,value,fragment", [
    ("phi3.rope.dimension_count", struct.pack("<I", 10), "rope_factors_long.weight must be F32 with "
                                                          "rope.dimension_count / 2 = 5 values; it is F32 with 6"),
    ("phi3.rope.dimension_count", struct.pack("<I", 13), "rope.dimension_count=13; expected an even number"),
    ("phi3.rope.dimension_count", struct.pack("<I", 18), "rope.dimension_count=18; expected an even number of at most"),
    ("phi3.rope.scaling.attn_factor", struct.pack("<f", -1.0), "attn_factor is -1.0; expected a positive number"),
])
def test_inconsistent_rope_metadata_is_refused_in_one_line(key, value, fragment, files, tmp_path):
    path = patched_metadata(files("phi3-longrope", "f32"), tmp_path / "bad.gguf", key, value)
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_one_factor_set_alone_is_refused(files, tmp_path):
    data = files("phi3-longrope", "f32").read_bytes()
    name = b"rope_factors_short.weight"
    assert data.count(name) == 1
    (tmp_path / "bad.gguf").write_bytes(data.replace(name, b"rope_factors_shorX.weight"))
    with pytest.raises(ModelLoadError, match=r"holds rope_factors_long\.weight without its pair"):
        load_hf_config(tmp_path / "bad.gguf")


def test_an_attention_factor_without_factor_sets_is_refused(files, tmp_path):
    data = files("phi3-longrope", "f32").read_bytes()
    for name in (b"rope_factors_long.weight", b"rope_factors_short.weight"):
        data = data.replace(name, name.replace(b"rope_", b"ropX_"))
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"attn_factor=1\.22\d* without rope_factors tensors"):
        load_hf_config(tmp_path / "bad.gguf")


def test_fused_rows_that_the_sizes_do_not_fill_are_refused(files, tmp_path, ops, model_registry):
    path = patched_metadata(files("phi3", "f32"), tmp_path / "bad.gguf", "phi3.feed_forward_length",
                            struct.pack("<I", 96))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight has 256 rows; the config's "
                                             r"mlp\.gate_proj 96 \+ mlp\.up_proj 96 give 192"):
        load_float_model(path, ops, model_registry)


def test_the_exporter_refuses_heads_that_do_not_span_the_hidden_size(sources, tmp_path):
    import json

    shutil.copytree(sources["phi3"], tmp_path / "wide")
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    config["head_dim"] = 32  # 4 heads of 32 != hidden 64: llama.cpp's phi3 sizes attn_output hidden x hidden
    (tmp_path / "wide" / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFExportError, match="llama.cpp's phi3 sizes attn_qkv and attn_output by the hidden size"):
        export_gguf(tmp_path / "wide", tmp_path / "out.gguf", "f32")
