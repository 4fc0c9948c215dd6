"""ChatGLM / GLM-4 GGUF files (`chatglm`) and GLM-4-0414 ones (`glm4`), written by flashllm's llama.cpp exporter
from tiny transformers GlmForCausalLM and Glm4ForCausalLM directories (partial adjacent-pair rotary, q/k/v biases,
grouped KV heads, fused gate_up_proj; Glm4's post-attention and post-MLP norms), load into the directory's model:
the configuration the directory's own, F32 logits equal to the directory's and greedy tokens equal to
transformers', the fused `attn_qkv` form (ChatGLMModel checkpoints) as the separate one, Q8_0 as the directory
rounded through Q8_0; a rotary part llama.cpp could not run is refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_config_fields,
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    patched_metadata,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.glm import build_glm  # noqa: E402
from flashllm.testing.tokenizer import train_tokenizer  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
CONFIG_FIELDS = ("architecture", "rotary_dim", "head_dim", "num_attention_heads", "num_key_value_heads", "qkv_bias",
                 "linear_bias", "final_norm", "rope_theta", "rope_scaling", "intermediate_size", "vocab_size",
                 "max_position_embeddings", "tie_word_embeddings", "num_hidden_layers")


KINDS = {"chatglm": False, "glm4": True}  # GGUF arch -> built as Glm4ForCausalLM


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    built = {}
    for arch, glm4 in KINDS.items():
        out = tmp_path_factory.mktemp(arch)
        tokenizer = train_tokenizer(out, vocab_size=300)  # the exporter writes the vocabulary
        build_glm(seed=3, vocab_size=len(tokenizer), glm4=glm4).save_pretrained(out)
        built[arch] = out
    return built


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    """(arch, "f32" | "q8_0") -> the exported GGUF file, written once."""
    return exports(tmp_path_factory.mktemp("gguf"), sources)


@pytest.mark.parametrize("arch", list(KINDS))
def test_the_file_holds_what_llama_cpp_s_converter_writes(arch, files):
    reader = gguf.GGUFReader(files(arch, "f32"))
    assert reader.fields["general.architecture"].contents() == arch
    fields = {k: reader.fields[f"{arch}.{k}"].contents() for k in (
        "rope.dimension_count", "attention.head_count", "attention.head_count_kv", "rope.freq_base")}
    assert fields == {"rope.dimension_count": 8, "attention.head_count": 4, "attention.head_count_kv": 2,
                      "rope.freq_base": 50000.0}
    stored = {t.name: t for t in reader.tensors}
    assert tuple(stored["blk.1.ffn_up.weight"].shape) == (64, 2 * 128)  # gate and up rows in one tensor
    assert {"blk.1.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias"} <= set(stored)
    assert ({"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(stored)) == KINDS[arch]


@pytest.mark.parametrize("arch", list(KINDS))
def test_config_is_the_directory_s(arch, sources, files):
    ours, _ = check_config_fields(files(arch, "f32"), sources[arch], CONFIG_FIELDS)
    assert ours.post_norms == KINDS[arch]


@pytest.mark.parametrize("arch", list(KINDS))
def test_f32_gguf_equals_its_source_directory_and_transformers(arch, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(arch, "f32"), sources[arch], ops, model_registry, paged_driver, PROMPT)


def _fused_qkv_copy(path: Path, out: Path) -> Path:
    """The file as llama.cpp's converter writes a ChatGLMModel checkpoint: each layer's attn_q, attn_k and attn_v
    (weights and biases) stacked along the rows into attn_qkv, q first."""
    def fused(tensors):
        for name, tensor in tensors.items():
            if ".attn_k." in name or ".attn_v." in name:
                continue
            if ".attn_q." in name:  # whole rows (of values or of blocks' bytes) stack as they are
                parts = [np.array(tensors[name.replace("attn_q", p)].data) for p in ("attn_q", "attn_k", "attn_v")]
                yield name.replace("attn_q", "attn_qkv"), np.ascontiguousarray(np.concatenate(parts)), tensor.tensor_type
            else:
                yield name, np.array(tensor.data), tensor.tensor_type

    return rewritten_copy(path, out, fused)


@pytest.mark.parametrize("arch", list(KINDS))
def test_a_fused_attn_qkv_file_loads_the_same_model(arch, files, ops, model_registry, paged_driver, tmp_path):
    fused = _fused_qkv_copy(files(arch, "f32"), tmp_path / "fused.gguf")
    assert "blk.0.attn_qkv.bias" in {t.name for t in gguf.GGUFReader(fused).tensors}
    ours = load_float_model(fused, ops, model_registry)
    separate = load_float_model(files(arch, "f32"), ops, model_registry)
    params = dict(ours.named_parameters())
    for name, param in separate.named_parameters():
        assert torch.equal(params[name], param), name
    assert torch.equal(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(separate, paged_driver, PROMPT))


@pytest.mark.parametrize("arch", list(KINDS))
def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(arch, sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files(arch, "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources[arch], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


@pytest.mark.parametrize("arch,fused", [("chatglm", False), ("chatglm", True), ("glm4", False)])
def test_two_ranks_decode_a_q8_0_file_as_one(arch, fused, files, tmp_path, monkeypatch, exact_w8_products):
    """Heads of the q / k / v blocks (one tensor or three) and gate / up rows split over two gloo ranks (exact fp32
    activations: the sums differ in order only) give one rank's greedy tokens and logprobs."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    path = files(arch, "q8_0")
    if fused:  # the Q8_0 file's q / k / v rows restacked as attn_qkv, blocks as stored
        path = _fused_qkv_copy(path, tmp_path / "fused.gguf")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], path)


@pytest.mark.parametrize("arch", list(KINDS))
def test_llm_runs_a_glm_gguf_file_like_its_directory(arch, sources, files):
    """The engine's own path (the cpu backend's runner, the file's vocabulary as tokenizer), not only the model."""
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for model in (sources[arch], files(arch, "f32")):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "hello"], params)])
    assert results[0] == results[1]


@pytest.mark.parametrize("value,fragment", [(7, "expected an even number of features in 1..16"),
                                            (32, "expected an even number of features in 1..16")])
def test_a_rotary_part_llama_cpp_cannot_run_is_refused_in_one_line(value, fragment, files, tmp_path):
    key = "chatglm.rope.dimension_count"
    assert gguf.GGUFReader(files("chatglm", "f32")).fields[key].types == [gguf.GGUFValueType.UINT32]
    path = patched_metadata(files("chatglm", "f32"), tmp_path / "bad.gguf", key, struct.pack("<I", value))
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_glm_4v_s_m_rope_sections_are_refused_in_one_line(files, tmp_path):
    path = rewritten_copy(files("glm4", "f32"), tmp_path / "mrope.gguf",
                          lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                          values={"glm4.rope.dimension_sections": [4, 4, 0, 0]})
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert "GLM-4V's M-RoPE" in str(err.value) and "\n" not in str(err.value)


def test_rope_scaling_is_not_exported(tmp_path):
    out = tmp_path / "scaled"
    model = build_glm(seed=1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5})
    model.save_pretrained(out)
    with pytest.raises(GGUFExportError, match="llama.cpp's chatglm converter writes plain rope"):
        export_gguf(out, tmp_path / "out.gguf")
