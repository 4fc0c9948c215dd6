"""GGUF export: tiny Llama / Qwen2 checkpoints read back with gguf's own reader equal the HF weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (pip install gguf)")

from flashllm.bench.gguf_export import (  # noqa: E402
    GGUFExportError,
    cached_gguf,
    export_gguf,
    permute_for_llama_rope,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_models")
    return {arch: build_tiny_model(root / arch, arch, seed=3) for arch in ("llama", "llama3", "qwen2", "qwen3")}


def hf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(model_dir / "model.safetensors"))


def unpermute_naive(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rope row order with loops: row 2i of a head came from i, 2i+1 from i + d/2."""
    head_dim = rows.shape[0] // num_heads
    out = np.empty_like(rows)
    for h in range(num_heads):
        for i in range(head_dim // 2):
            out[h * head_dim + i] = rows[h * head_dim + 2 * i]
            out[h * head_dim + head_dim // 2 + i] = rows[h * head_dim + 2 * i + 1]
    return out


def fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {name: field.contents() for name, field in reader.fields.items()}


def tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader.tensors}


HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def expected_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_metadata_matches_config(models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    config = json.loads((models[arch] / "config.json").read_text())
    reader = gguf.GGUFReader(export_gguf(models[arch], tmp_path / "m.gguf", "f32"))
    meta = fields(reader)
    prefix = {"llama": "llama", "qwen2": "qwen2"}[arch]
    assert meta["general.architecture"] == prefix
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    expected = {
        "context_length": config["max_position_embeddings"], "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"], "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "rope.dimension_count": head_dim, "vocab_size": config["vocab_size"],
    }
    for key, value in expected.items():
        assert meta[f"{prefix}.{key}"] == value, key
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert math.isclose(meta[f"{prefix}.rope.freq_base"], rope_theta, rel_tol=1e-6)
    assert math.isclose(meta[f"{prefix}.attention.layer_norm_rms_epsilon"], config["rms_norm_eps"], rel_tol=1e-6)
    assert meta["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    assert meta["tokenizer.ggml.eos_token_id"] == config["eos_token_id"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_round_trips(models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(models[arch] / "tokenizer.json"))
    meta = fields(gguf.GGUFReader(export_gguf(models[arch], tmp_path / "m.gguf", "f32")))
    tokens = meta["tokenizer.ggml.tokens"]
    # the pre-tokenizer of the tokenizer transformers loads: for a Qwen2 model transformers 5 splits with
    # Qwen2's pattern whatever tokenizer.json says (tests/e2e/test_bench_llama_server.py checks llama-server's ids)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == {"qwen2": "qwen2"}.get(arch, "gpt-2")
    assert tokens == [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    types = meta["tokenizer.ggml.token_type"]
    assert {tokens[i] for i, kind in enumerate(types) if kind == gguf.TokenType.CONTROL} == special
    merges = json.loads((models[arch] / "tokenizer.json").read_text())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges]


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_f32_tensors_equal_hf_weights(models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    config = json.loads((models[arch] / "config.json").read_text())
    written = tensors(gguf.GGUFReader(export_gguf(models[arch], tmp_path / "m.gguf", "f32")))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    expected_names = set()
    for hf_name, hf in hf_weights(models[arch]).items():
        name = expected_name(hf_name)
        expected_names.add(name)
        got = np.asarray(written[name].data).reshape(hf.shape)
        assert written[name].tensor_type == gguf.GGMLQuantizationType.F32
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if arch.startswith("llama") and kind in heads:
            got = unpermute_naive(got, heads[kind])
        np.testing.assert_array_equal(got, hf, err_msg=name)
    extra = set(written) - expected_names
    assert extra == ({"rope_freqs.weight"} if arch == "llama3" else set())
    if arch == "qwen2":  # tied: llama.cpp falls back to token_embd, and qkv biases are kept
        assert "output.weight" not in written and "blk.0.attn_q.bias" in written


def test_llama3_rope_factors_match_transformers(models: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(models["llama3"])
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    head_dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    written = tensors(gguf.GGUFReader(export_gguf(models["llama3"], tmp_path / "m.gguf", "f32")))
    factors = np.asarray(written["rope_freqs.weight"].data)
    np.testing.assert_allclose(factors, plain / scaled.double().numpy(), rtol=1e-5)
    assert factors.min() >= 1.0 and factors.max() > 1.0  # the preset puts frequencies in every band


@pytest.mark.parametrize("file_type", ["f16", "bf16", "q8_0"])
def test_reduced_file_types_dequantize_close(models: dict[str, Path], tmp_path: Path, file_type: str) -> None:
    written = tensors(gguf.GGUFReader(export_gguf(models["qwen2"], tmp_path / "m.gguf", file_type)))
    for hf_name, hf in hf_weights(models["qwen2"]).items():
        t = written[expected_name(hf_name)]
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(hf.shape)
        if hf.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(got, hf)
            continue
        assert t.tensor_type.name == file_type.upper()
        # per-element error bound: half an ulp (f16, bf16); for Q8_0 half a step of its block plus the
        # rounding of the step itself to f16 (up to 127 steps times 2**-11)
        rel = {"f16": 2.0**-11, "bf16": 2.0**-8}.get(file_type)
        if rel is not None:
            np.testing.assert_allclose(got, hf, rtol=rel, atol=1e-7)
        else:
            step = np.abs(hf.reshape(hf.shape[0], -1, 32)).max(axis=-1, keepdims=True) / 127
            assert (np.abs(got - hf).reshape(step.shape[0], -1, 32) <= step * (0.5 + 127 * 2.0**-11) + 1e-7).all()


@settings(max_examples=40, deadline=None)
@given(num_heads=st.integers(1, 5), half=st.integers(1, 6), cols=st.integers(0, 3))
def test_permutation_is_undone_by_the_naive_inverse(num_heads: int, half: int, cols: int) -> None:
    shape = (num_heads * 2 * half, cols) if cols else (num_heads * 2 * half,)
    rows = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = permute_for_llama_rope(rows, num_heads)
    assert permuted.shape == rows.shape
    np.testing.assert_array_equal(unpermute_naive(permuted, num_heads), rows)


def test_cache_reuses_the_file_and_rekeys_on_new_weights(models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    first = cached_gguf(models["llama"], "f32", cache_dir=tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(models["llama"], "f32", cache_dir=tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == stamp and first.parent == tmp_path / "cache" / "gguf"
    changed = shutil.copytree(models["llama"], tmp_path / "changed")
    build_tiny_model(changed, "llama", seed=4)
    assert cached_gguf(changed, "f32", cache_dir=tmp_path / "cache") != first
    assert not list((tmp_path / "cache" / "gguf").glob(".*"))  # no temporary files left behind


def test_refusals_say_what_to_do(models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    no_tok = shutil.copytree(models["llama"], tmp_path / "no_tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(GGUFExportError, match="tokenizer.json"):
        export_gguf(no_tok, tmp_path / "a.gguf")
    with pytest.raises(GGUFExportError, match="q8_0"):
        export_gguf(models["llama"], tmp_path / "b.gguf", "q4_k")
    small = shutil.copytree(models["llama"], tmp_path / "small")
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 100  # the tokenizer has more tokens than embedding rows
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFExportError, match="embedding has 100 rows"):
        export_gguf(small, tmp_path / "c.gguf")
    assert not (tmp_path / "c.gguf").exists()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_an_exported_f32_file_runs_as_its_source_directory(models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    """flashllm's own GGUF reader takes the exporter's file back: same greedy tokens, logprobs to float noise."""
    from flashllm import LLM, SamplingParams

    path = export_gguf(models[arch], tmp_path / "m.gguf", "f32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompt = [[5, 17, 99, 3, 250, 41, 8, 300, 77, 12]]
    runs = [LLM(str(source), dtype="float32", device="cpu", block_size=16, num_kv_blocks=16, max_model_len=128)
            .generate(prompt, params)[0]
            for source in (models[arch], path)]
    assert runs[1].outputs[0].token_ids == runs[0].outputs[0].token_ids
    assert max(abs(a - b) for a, b in zip(runs[0].outputs[0].logprobs, runs[1].outputs[0].logprobs, strict=True)) < 1e-4
