"""First-generation Qwen (`qwen`) and Baichuan (`baichuan`) GGUF files, written by flashllm's llama.cpp exporter from
tiny QWen / Baichuan directories (themselves transformers' Qwen2 / Llama weights under the remote-code models' names),
load as llama.cpp runs them: Qwen as Qwen2's decoder with attn_qkv cut into q, k, v; Baichuan with RoPE at 32 layers,
ALiBi at 40 and Baichuan2's normalized head. Checked against the directories and transformers."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.first_generation import baichuan_from_llama, qwen_from_qwen2  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    patched_metadata,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
BAICHUAN2_VOCAB = 125696


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """kind -> (the directory exported, the transformers directory it equals, or None)."""
    root = tmp_path_factory.mktemp("first-generation")
    qwen2 = build_tiny_model(root / "qwen2", "qwen2", seed=3, num_key_value_heads=4, tie_word_embeddings=False)
    rope = build_tiny_model(root / "llama32", "llama", seed=5, num_key_value_heads=4, num_hidden_layers=32)
    alibi = build_tiny_model(root / "llama40", "llama", seed=6, num_key_value_heads=4, num_hidden_layers=40)
    return {"qwen": qwen_from_qwen2(qwen2, root / "qwen"), "qwen2": qwen2,
            "baichuan-7b": baichuan_from_llama(rope, root / "baichuan-7b"), "llama32": rope,
            "baichuan-13b": baichuan_from_llama(alibi, root / "baichuan-13b", position_embedding="alibi")}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def test_the_qwen_file_holds_what_llama_cpp_s_converter_writes(sources, files):
    reader = gguf.GGUFReader(files("qwen", "f32"))
    assert reader.fields["general.architecture"].contents() == "qwen"
    assert reader.fields["qwen.feed_forward_length"].contents() == 256  # QWen's intermediate_size: 2 x 128
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    qwen = load_file(str(sources["qwen"] / "model.safetensors"))
    for part, name in (("attn_qkv", "attn.c_attn"), ("ffn_up", "mlp.w1"), ("ffn_gate", "mlp.w2")):
        assert np.array_equal(stored[f"blk.1.{part}.weight"], qwen[f"transformer.h.1.{name}.weight"].numpy()), part
    assert np.array_equal(stored["blk.1.attn_qkv.bias"], qwen["transformer.h.1.attn.c_attn.bias"].numpy())
    assert "blk.1.attn_output.bias" not in stored


def test_a_qwen_file_is_its_qwen2_twin(sources, files):
    ours, expected = load_hf_config(files("qwen", "f32")), load_hf_config(sources["qwen2"])
    for field in ("architecture", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rotary_dim", "rope_theta", "vocab_size", "tie_word_embeddings", "attention_bias"):
        assert getattr(ours, field) == getattr(expected, field), field


@pytest.mark.parametrize(("kind", "twin"), [("qwen", "qwen2"), ("baichuan-7b", "llama32")])
def test_f32_file_equals_transformers_on_the_twin_directory(kind, twin, sources, files, ops, model_registry,
                                                            paged_driver):
    check_f32_file(files(kind, "f32"), sources[twin], ops, model_registry, paged_driver, PROMPT)


def test_q8_0_qwen_file_equals_the_directory_rounded(sources, files, ops, model_registry, paged_driver, tmp_path):
    ours = load_float_model(files("qwen", "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources["qwen2"], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_two_ranks_cut_attn_qkv_and_decode_a_q8_0_qwen_file_as_one(files, monkeypatch, exact_w8_products):
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("qwen", "q8_0"))


def test_a_40_layer_baichuan_file_runs_alibi_as_its_directory(sources, files, ops, model_registry, paged_driver):
    config = load_hf_config(files("baichuan-13b", "f32"))
    assert (config.position_embedding, config.norm_head) == ("alibi", False)
    ours = prompt_logits(load_float_model(files("baichuan-13b", "f32"), ops, model_registry), paged_driver, PROMPT)
    directory = load_float_model(sources["baichuan-13b"], ops, model_registry)
    torch.testing.assert_close(ours, prompt_logits(directory, paged_driver, PROMPT), rtol=0, atol=1e-5)


def test_the_engine_serves_a_baichuan_alibi_file_as_its_directory(sources, files):
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = []
    for path in (files("baichuan-13b", "f32"), sources["baichuan-13b"]):
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=32, max_model_len=128)
        outs = llm.generate([PROMPT, [7, 3, 250]], params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(*runs, strict=True):
        assert tokens1 == tokens2
        torch.testing.assert_close(torch.tensor(logprobs1), torch.tensor(logprobs2), rtol=0, atol=1e-5)


def test_a_baichuan2_file_s_head_is_normalized_whether_or_not_the_file_s_rows_are(tmp_path, ops, model_registry,
                                                                                   paged_driver):
    """Baichuan2's vocabulary: the exporter writes the head's rows normalized (Baichuan's advice for llama.cpp) and
    the loader normalizes them (again, a no-op); a file holding the rows as trained (llama.cpp's converter's) gives
    the same logits, the directory's."""
    llama = build_tiny_model(tmp_path / "llama", "llama", seed=7, num_key_value_heads=4, num_hidden_layers=32,
                             hidden_size=32, intermediate_size=64, vocab_size=BAICHUAN2_VOCAB)
    directory = baichuan_from_llama(llama, tmp_path / "baichuan2")
    path = export_gguf(directory, tmp_path / "baichuan2.gguf")
    assert load_hf_config(path).norm_head
    head = load_file(str(directory / "model.safetensors"))["lm_head.weight"]
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}["output.weight"]
    np.testing.assert_allclose(np.linalg.norm(stored, axis=-1), 1.0, rtol=1e-5)

    def trained_head(tensors):
        for name, tensor in tensors.items():
            yield name, (head.numpy() if name == "output.weight" else np.array(tensor.data)), tensor.tensor_type

    as_trained = rewritten_copy(path, tmp_path / "trained-head.gguf", trained_head)
    expected = prompt_logits(load_float_model(directory, ops, model_registry), paged_driver, PROMPT)
    for file in (path, as_trained):
        ours = prompt_logits(load_float_model(file, ops, model_registry), paged_driver, PROMPT)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_what_llama_cpp_runs_otherwise_is_refused_in_one_line(files, tmp_path):
    for kind, key, value, message in (
            ("baichuan-7b", "baichuan.block_count", 31, "has 31 layers; llama.cpp's baichuan graph rotates 32-layer"),
            ("qwen", "qwen.attention.head_count_kv", 2, "head_count_kv is 2, not head_count 4"),
            ("qwen", "qwen.feed_forward_length", 255, "feed_forward_length 255 is odd")):
        path = patched_metadata(files(kind, "f32"), tmp_path / f"{key}.gguf", key, struct.pack("<I", value))
        with pytest.raises(ModelLoadError, match=message):
            load_hf_config(path)

    def with_output_bias(tensors):
        for name, tensor in tensors.items():
            yield name, np.array(tensor.data), tensor.tensor_type
        yield "blk.0.attn_output.bias", np.zeros(64, dtype=np.float32), None

    biased = rewritten_copy(files("qwen", "f32"), tmp_path / "bias.gguf", with_output_bias)
    with pytest.raises(ModelLoadError, match="attn_output / MLP biases, which llama.cpp's qwen graph never adds"):
        load_hf_config(biased)


def test_directories_llama_cpp_would_run_otherwise_are_not_exported(sources, tmp_path):
    qwen2 = sources["qwen2"]
    for name, config, message in (
            ("biased", {"no_bias": False}, "no_bias=false has no GGUF export here"),
            ("logn", {"use_logn_attn": True, "seq_length": 64}, "past seq_length=64 .* llama.cpp runs plain RoPE"),
            ("partial", {"rotary_pct": 0.5}, "rotary_pct < 1")):
        directory = qwen_from_qwen2(qwen2, tmp_path / name, **config)
        with pytest.raises(GGUFExportError, match=message):
            export_gguf(directory, tmp_path / f"{name}.gguf")
    alibi_32 = baichuan_from_llama(sources["llama32"], tmp_path / "alibi-32", position_embedding="alibi")
    with pytest.raises(GGUFExportError, match="32-layer Baichuan using alibi .* runs rope for it"):
        export_gguf(alibi_32, tmp_path / "alibi-32.gguf")
