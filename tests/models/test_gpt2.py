"""GPT-2 (GPTBigCode's block with multi-head attention and transposed Conv1D weights): config.json read as
transformers' GPT2Config reads it, the layer-scaled and unscaled scores, an untied head and the original gpt2 files'
names (no `transformer.` prefix, causal-mask buffers) against transformers, c_attn's row order, and tensor
parallelism. The tiny preset's paged-forward and engine parity with transformers run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.gpt2 import GPT2Model, gpt2_tensors
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
       "vocab_size": 256, "n_positions": 512}


@pytest.mark.parametrize("changes", [
    {}, {"n_inner": 96, "layer_norm_epsilon": 1e-3, "activation_function": "gelu", "scale_attn_weights": False},
    {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True, "tie_word_embeddings": False,
     "multi_query": True, "num_key_value_heads": 1, "intermediate_size": 100},  # the last three: not GPT-2's fields
    {"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 3, "max_position_embeddings": 64,
     "n_embd": None, "n_head": None, "n_layer": None, "n_positions": None},  # the generic names (attribute_map)
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import GPT2Config

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    ours, theirs = parse_hf_config(raw), GPT2Config(**raw)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.intermediate_size == (theirs.n_inner or 4 * theirs.n_embd)
    assert (ours.hidden_act, ours.rms_norm_eps) == (theirs.activation_function, theirs.layer_norm_epsilon)
    assert ours.num_key_value_heads == theirs.n_head and ours.head_dim == theirs.n_embd // theirs.n_head
    for field in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        assert ours.raw[field] == getattr(theirs, field), field


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import GPT2Config

    ours, theirs = parse_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}), GPT2Config()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.intermediate_size, ours.num_key_value_heads, ours.head_dim) == (4 * 768, 12, 64)
    assert (ours.hidden_act, ours.rms_norm_eps) == (theirs.activation_function, theirs.layer_norm_epsilon)
    assert not ours.raw["scale_attn_by_inverse_layer_idx"] and ours.raw["scale_attn_weights"]


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"activation_function": "swish"}, "hidden_act='swish' is not supported"),
    ({"scale_attn_by_inverse_layer_idx": "no"}, "scale_attn_by_inverse_layer_idx='no' must be true or false"),
    ({"reorder_and_upcast_attn": 0}, "reorder_and_upcast_attn=0 must be true or false"),
    ({"n_embd": 66}, "not divisible by num_attention_heads=4"),
    ({"add_cross_attention": True}, "add_cross_attention=true"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "GPT-2 loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


def test_conv1d_weights_are_transposed_and_c_attn_cut_in_thirds() -> None:
    config = parse_hf_config(RAW)
    weight = torch.arange(64 * 192, dtype=torch.float32).view(64, 192)  # Conv1D: (in, out)
    parts = dict(gpt2_tensors([("h.0.attn.c_attn.weight", weight), ("h.0.mlp.c_fc.weight", weight[:, :96]),
                               ("h.0.ln_1.weight", torch.ones(64))], config))
    assert set(parts) == {"transformer.h.0.attn.q_proj.weight", "transformer.h.0.attn.k_proj.weight",
                          "transformer.h.0.attn.v_proj.weight", "transformer.h.0.mlp.c_fc.weight",
                          "transformer.h.0.ln_1.weight"}
    assert torch.equal(parts["transformer.h.0.attn.k_proj.weight"], weight[:, 64:128].t())
    assert torch.equal(parts["transformer.h.0.mlp.c_fc.weight"], weight[:, :96].t())
    with pytest.raises(ModelLoadError, match="c_attn.bias"):
        list(gpt2_tensors([("transformer.h.0.attn.c_attn.bias", torch.zeros(190))], config))


@pytest.mark.parametrize("changes", [
    {"scale_attn_by_inverse_layer_idx": True, "tie_word_embeddings": False},
    {"scale_attn_weights": False, "n_inner": 80, "activation_function": "gelu"},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset is gpt2's shape; each layer's scores over its index + 1 with an untied head, and unscaled scores
    with a narrower exact-GELU MLP."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gpt2", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert isinstance(model.model, GPT2Model)
    scales = [layer.self_attn.attn.scale for layer in model.model.layers]
    assert scales == ([0.25, 0.125] if changes.get("scale_attn_by_inverse_layer_idx") else
                      [0.25, 0.25] if changes.get("scale_attn_weights", True) else [1.0, 1.0])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == changes.get("tie_word_embeddings", True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_the_original_gpt2_files_names_load(tmp_path) -> None:
    """The gpt2 hub files: names without `transformer.`, each layer's causal-mask buffers `attn.bias` /
    `attn.masked_bias`, no lm_head (tied)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gpt2", seed=7, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = {name.removeprefix("transformer."): tensor for name, tensor in
               load_file(model_dir / "model.safetensors").items() if name != "lm_head.weight"}
    for layer in range(2):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (5, 33)], 6)


@pytest.mark.parametrize("changes", [{}, {"scale_attn_by_inverse_layer_idx": True}])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(changes, tmp_path) -> None:
    """Each rank takes its heads' rows of every c_attn third (and its columns of every transposed c_proj)."""
    model_dir = build_tiny_model(tmp_path / "gpt2", "gpt2", seed=2, tokenizer=False, **changes)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
