"""gpt-oss GGUF files (`gpt-oss`), written by flashllm's llama.cpp exporter from a tiny transformers GptOssForCausalLM
directory (per-head sinks, biased experts, even layers sliding, YaRN with llama.cpp's rounded correction range): the
converter's tensors, the directory's configuration, F32 logits equal to the directory's and greedy tokens equal to
transformers', Q8_0 (experts kept as blocks, with their biases) and MXFP4 experts (the published files' format) as the
directory rounded through them, two ranks as one; a file without sinks or window refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    export_of,
    load_float_model,
    moe_source,
    prompt_logits,
    rewritten_copy,
    round_trip_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_moe import GPT_OSS_PRESET, build_moe_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
CONFIG_FIELDS = ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "sliding_windows",
                 "rope_theta", "attention_bias", "head_dim", "num_key_value_heads", "vocab_size",
                 "tie_word_embeddings", "num_hidden_layers")
# llama.cpp's YaRN rounds its correction range: what the file runs, so what the source must run to compare
ROPE = {**GPT_OSS_PRESET[2]["rope_parameters"], "truncate": True}
STACKED = ("experts.gate_up_proj", "experts.down_proj")  # stored (E, K, N): a file's rows are their columns


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # experts 64 wide: their down rows are whole 32-value blocks, so every stack is quantized in the files
    return moe_source(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=3, rope_parameters=ROPE, intermediate_size=64)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    return export_of(tmp_path_factory.mktemp("gguf"), "gpt_oss", source)


def test_the_file_holds_the_converter_s_tensors(source, files):
    reader = gguf.GGUFReader(files("mxfp4"))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("gpt-oss.")}
    assert (fields["gpt-oss.expert_count"], fields["gpt-oss.attention.sliding_window"]) == (4, 8)
    assert fields["gpt-oss.rope.scaling.type"] == "yarn" and fields["gpt-oss.rope.scaling.factor"] == 8.0
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "F32"
    stored = {name: np.array(t.data) for name, t in tensors.items() if t.tensor_type.name == "F32"}
    checkpoint = load_file(str(source / "model.safetensors"))
    gate_up_bias = checkpoint["model.layers.1.mlp.experts.gate_up_proj_bias"].numpy()
    assert np.array_equal(stored["blk.1.ffn_gate_exps.bias"], gate_up_bias[:, 0::2])  # interleaved: gate, up, ...
    assert np.array_equal(stored["blk.1.ffn_up_exps.bias"], gate_up_bias[:, 1::2])
    assert np.array_equal(stored["blk.1.attn_sinks.weight"], checkpoint["model.layers.1.self_attn.sinks"].numpy())
    assert "blk.1.post_attention_norm.weight" in stored and "blk.1.ffn_gate_inp.bias" in stored


def test_config_is_the_directory_s(source, files):
    ours, _ = check_config_fields(files("f32"), source, CONFIG_FIELDS, approx=())
    assert ours.rope_scaling["rope_type"] == "yarn" and ours.rope_scaling.get("truncate", True) is True


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


@pytest.mark.parametrize(("file_type", "rounded_as"), [("q8_0", "Q8_0"), ("mxfp4", "MXFP4")])
def test_quantized_gguf_equals_the_directory_rounded_as_the_file(file_type, rounded_as, source, files, ops,
                                                                 model_registry, paged_driver, tmp_path):
    """Q8_0: every matrix in blocks; MXFP4: the expert stacks, the rest F32. The experts stay as the file's blocks
    (MXFP4's as int8 codes with power-of-two scales, exactly), run with their biases. Either gives the directory's
    logits with those matrices rounded through the file's type, and not the directory's own."""
    ours = load_float_model(files(file_type), ops, model_registry)
    w13, _ = ours.model.layers[0].mlp.experts.expert_blocks[0]  # kept as the file's blocks
    assert w13.gguf_type == rounded_as and w13.scheme == "w8a16"

    def type_of(name: str) -> str | None:
        if name.endswith(("router.weight", "_bias", "sinks")) or (file_type == "mxfp4" and not name.endswith(STACKED)):
            return None
        return rounded_as

    rounded = round_trip_copy(source, tmp_path / "rounded", type_of, transposed=lambda name: name.endswith(STACKED))
    logits = prompt_logits(ours, paged_driver, PROMPT)
    expected = prompt_logits(load_float_model(rounded, ops, model_registry), paged_driver, PROMPT)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    unrounded = prompt_logits(load_float_model(source, ops, model_registry), paged_driver, PROMPT)
    assert (unrounded - logits).abs().max() > 1e-4


@pytest.mark.parametrize(("file_type", "options"), [("q8_0", {}), ("q8_0", {"enable_expert_parallel": True}),
                                                    ("mxfp4", {})], ids=["q8_0-tensor", "q8_0-expert", "mxfp4-tensor"])
def test_two_ranks_decode_a_quantized_file_as_one(file_type, options, files, monkeypatch, exact_w8_products):
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files(file_type), **options)


def test_a_file_without_sinks_or_window_is_refused(files, tmp_path):
    for dropped_tensor, values, fragment in (("attn_sinks.weight", {}, "lacks blk.0.attn_sinks.weight"),
                                             ("", {"gpt-oss.attention.sliding_window": 0}, "positive window")):
        path = rewritten_copy(files("f32"), tmp_path / f"bad-{len(fragment)}.gguf", lambda tensors, drop=dropped_tensor: (
            (name, np.array(t.data), None) for name, t in tensors.items() if not drop or not name.endswith(drop)),
            values=values)
        with pytest.raises(ModelLoadError, match=fragment):
            load_hf_config(path)


def test_the_exporter_refuses_the_published_yarn(tmp_path):
    model = build_moe_model(tmp_path / "truncated", "gpt_oss", seed=1)  # the preset's truncate: false
    with pytest.raises(GGUFExportError, match="truncate=true"):
        export_gguf(model, tmp_path / "model.gguf")
