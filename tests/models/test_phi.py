"""Phi (phi-1 / 1.5 / 2: the parallel block, partial RoPE, biases on every projection and on the LM head): config.json
read as transformers' PhiConfig reads it, q / k LayerNorms and tied embeddings honored against transformers, tensor
parallelism, and GGUF `phi2` files written by flashllm's llama.cpp exporter loading as llama.cpp runs them. The tiny
preset's paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.llm import LLM  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config, parse_hf_config  # noqa: E402
from flashllm.models.layers.norm import LayerNorm  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
)
from flashllm.testing.parity import check_engine_greedy_against, random_tokens  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.mark.parametrize("changes", [
    {}, {"partial_rotary_factor": 0.4, "layer_norm_eps": 1e-3, "tie_word_embeddings": True, "hidden_act": "gelu"},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.75},
     "num_key_value_heads": 2, "qk_layernorm": True, "max_position_embeddings": 4096, "sliding_window": 8},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import PhiConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), PhiConfig(**{**RAW, **changes})
    head_dim = theirs.hidden_size // theirs.num_attention_heads
    assert ours.rotary_dim == int(head_dim * theirs.rope_parameters["partial_rotary_factor"])
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.layer_norm_eps
    assert (ours.tie_word_embeddings, ours.hidden_act) == (theirs.tie_word_embeddings, theirs.hidden_act)
    assert (ours.max_position_embeddings, ours.num_key_value_heads) == (theirs.max_position_embeddings,
                                                                        theirs.num_key_value_heads)
    assert ours.raw["qk_layernorm"] == theirs.qk_layernorm
    assert ours.attention_bias and ours.mlp_bias
    assert ours.sliding_windows == (None, None)  # transformers' Phi reads no window


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import PhiConfig

    ours, theirs = parse_hf_config({"architectures": ["PhiForCausalLM"], "model_type": "phi"}), PhiConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rotary_dim == int(64 * theirs.rope_parameters["partial_rotary_factor"]) == 32


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ({"qk_layernorm": "yes"}, "qk_layernorm='yes' must be true or false"),
    ({"qk_layernorm": True, "head_dim": 32}, "qk_layernorm with head_dim=32"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("changes", [{"qk_layernorm": True}, {"tie_word_embeddings": True}])
def test_q_k_layernorms_and_tied_embeddings_match_transformers(changes, tmp_path) -> None:
    """The preset has neither: q / k LayerNorms over each head before RoPE; a tied head keeping its own bias."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "phi", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert isinstance(model.model.layers[0].self_attn.q_norm, LayerNorm) == bool(changes.get("qk_layernorm"))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(changes.get("tie_word_embeddings"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Attention and MLP outputs each reduced over the ranks, the LM head's bias split with its rows, the q / k
    LayerNorms per head on each rank's heads."""
    model_dir = build_tiny_model(tmp_path / "phi", "phi", seed=2, tokenizer=False, qk_layernorm=True)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("phi"), "phi", seed=3)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    get = exports(tmp_path_factory.mktemp("gguf"), {"phi": source})
    return lambda file_type: get("phi", file_type)


def test_the_file_holds_the_converter_s_names_and_metadata(source, files) -> None:
    reader = gguf.GGUFReader(files("f32"))
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(source / "model.safetensors"))
    for part, module in (("attn_output.bias", "self_attn.dense.bias"), ("ffn_up.weight", "mlp.fc1.weight"),
                         ("ffn_down.bias", "mlp.fc2.bias"), ("attn_norm.bias", "input_layernorm.bias"),
                         ("attn_q.weight", "self_attn.q_proj.weight")):
        assert np.array_equal(stored[f"blk.1.{part}"], weights[f"model.layers.1.{module}"].numpy()), part
    assert np.array_equal(stored["output_norm.bias"], weights["model.final_layernorm.bias"].numpy())
    assert np.array_equal(stored["output.bias"], weights["lm_head.bias"].numpy())
    assert "blk.0.ffn_norm.weight" not in stored  # one norm per layer
    fields = {key: reader.fields[f"phi2.{key}"] for key in ("attention.layer_norm_epsilon", "rope.dimension_count")}
    values = {key: field.parts[field.data[0]][0] for key, field in fields.items()}
    assert float(values["attention.layer_norm_epsilon"]) == pytest.approx(1e-5)
    assert int(values["rope.dimension_count"]) == 6


def test_a_gguf_file_loads_the_directory_s_config(source, files) -> None:
    ours, expected = load_hf_config(files("f32")), load_hf_config(source)
    assert ours.architecture == "PhiForCausalLM"
    for field in ("hidden_act", "rotary_dim", "num_key_value_heads", "tie_word_embeddings", "sliding_windows",
                  "vocab_size", "intermediate_size"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


def test_f32_gguf_equals_its_source_directory_and_transformers(source, files, ops, model_registry, paged_driver):
    check_f32_file(files("f32"), source, ops, model_registry, paged_driver, PROMPT)


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(source, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("q8_0"), ops, model_registry)
    check_q8_0_logits(ours, source, ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def _fused_qkv_copy(path: Path, out: Path) -> Path:
    """The file as older conversions of phi-2 hold it: each layer's attn_q, attn_k and attn_v (weights and biases)
    stacked along the rows into attn_qkv, q first."""
    def fused(tensors):
        for name, tensor in tensors.items():
            if ".attn_k." in name or ".attn_v." in name:
                continue
            if ".attn_q." in name:
                parts = [np.array(tensors[name.replace("attn_q", p)].data) for p in ("attn_q", "attn_k", "attn_v")]
                yield name.replace("attn_q", "attn_qkv"), np.ascontiguousarray(np.concatenate(parts)), tensor.tensor_type
            else:
                yield name, np.array(tensor.data), tensor.tensor_type

    return rewritten_copy(path, out, fused)


def test_a_fused_attn_qkv_file_loads_the_same_model(files, ops, model_registry, paged_driver, tmp_path) -> None:
    fused = _fused_qkv_copy(files("f32"), tmp_path / "fused.gguf")
    assert "blk.0.attn_qkv.bias" in {t.name for t in gguf.GGUFReader(fused).tensors}
    ours, separate = load_float_model(fused, ops, model_registry), load_float_model(files("f32"), ops, model_registry)
    assert torch.equal(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(separate, paged_driver, PROMPT))


def test_a_file_llama_cpp_would_not_load_is_refused(files, tmp_path) -> None:
    def without_head_bias(tensors):
        for name, tensor in tensors.items():
            if name != "output.bias":
                yield name, np.array(tensor.data), tensor.tensor_type

    broken = rewritten_copy(files("f32"), tmp_path / "no-bias.gguf", without_head_bias)
    with pytest.raises(ModelLoadError, match="lacks output.bias"):
        load_hf_config(broken)


@pytest.mark.parametrize(("changes", "fragment"), [({"qk_layernorm": True}, "qk_layernorm"),
                                                   ({"tie_word_embeddings": True}, "tie_word_embeddings")])
def test_what_llama_cpp_would_run_differently_has_no_export(changes, fragment, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "phi", seed=1, **changes)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(model_dir, tmp_path / "model.gguf")
