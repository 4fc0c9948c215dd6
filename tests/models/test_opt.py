"""OPT (learned positions at offset 2, separate biased q / k / v, a ReLU MLP; opt-350m's post-norm block with
project_in / project_out): config.json read as transformers' OPTConfig reads it, the post-norm 350m shape, the
bias-free, weightless-norm and no-final-norm variants against transformers, the original `decoder.*` names, and
tensor parallelism. The tiny preset's paged-forward and engine parity with transformers run in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.opt import OPTPostNormLayer, ProjectedEmbedding, ResidualAdd
from flashllm.models.starcoder2 import Starcoder2DecoderLayer
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "ffn_dim": 96, "vocab_size": 256, "max_position_embeddings": 512}
OPT_350M = {"word_embed_proj_dim": 32, "do_layer_norm_before": False}  # opt-350m's shape, halved


@pytest.mark.parametrize("changes", [
    {}, OPT_350M,
    {"enable_bias": False, "layer_norm_elementwise_affine": False, "activation_function": "gelu",
     "tie_word_embeddings": False, "_remove_final_layer_norm": True, "word_embed_proj_dim": 64},
    {"num_key_value_heads": 1, "intermediate_size": 100, "rms_norm_eps": 0.1, "head_dim": 8},  # not OPT's fields
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import OPTConfig

    raw = {**RAW, **changes}
    ours, theirs = parse_hf_config(raw), OPTConfig(**raw)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.intermediate_size, ours.hidden_act) == (theirs.ffn_dim, theirs.activation_function)
    assert ours.num_key_value_heads == theirs.num_attention_heads and ours.head_dim == 16
    assert ours.attention_bias == ours.mlp_bias == theirs.enable_bias
    for field in ("do_layer_norm_before", "_remove_final_layer_norm", "layer_norm_elementwise_affine",
                  "word_embed_proj_dim"):
        assert ours.raw[field] == getattr(theirs, field), field


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import OPTConfig

    ours, theirs = parse_hf_config({"architectures": ["OPTForCausalLM"], "model_type": "opt"}), OPTConfig()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.intermediate_size, ours.hidden_act) == (theirs.ffn_dim, theirs.activation_function)
    assert ours.rms_norm_eps == torch.nn.LayerNorm(4).eps and ours.attention_bias == theirs.enable_bias
    for field in ("do_layer_norm_before", "_remove_final_layer_norm", "layer_norm_elementwise_affine",
                  "word_embed_proj_dim", "pad_token_id"):
        assert ours.raw[field] == getattr(theirs, field), field


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"activation_function": "swish"}, "hidden_act='swish' is not supported"),
    ({"do_layer_norm_before": "no"}, "do_layer_norm_before='no' must be true or false"),
    ({"enable_bias": 1}, "enable_bias=1 must be true or false"),
    ({"word_embed_proj_dim": 0}, "word_embed_proj_dim=0 must be a positive int"),
    ({"hidden_size": 66}, "not divisible by num_attention_heads=4"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "OPT loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("changes", [
    OPT_350M,
    {"enable_bias": False, "layer_norm_elementwise_affine": False, "tie_word_embeddings": False},
    {"_remove_final_layer_norm": True, "activation_function": "gelu"},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset is opt-125m's pre-norm block; opt-350m's post-norm block between project_in and project_out, no
    biases and no norm parameters under an untied head, and no final norm with an exact-GELU MLP."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "opt", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    stack = model.model
    post_norm = not changes.get("do_layer_norm_before", True)
    assert isinstance(stack.layers[0], OPTPostNormLayer if post_norm else Starcoder2DecoderLayer)
    assert isinstance(stack.norm, ResidualAdd) == (post_norm or changes.get("_remove_final_layer_norm", False))
    assert isinstance(stack.embed_tokens, ProjectedEmbedding) == ("word_embed_proj_dim" in changes)
    assert (stack.layers[0].self_attn.qkv_proj.bias is not None) == changes.get("enable_bias", True)
    assert (model.lm_head.weight is stack.embed_tokens.weight) == changes.get("tie_word_embeddings", True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_the_original_decoder_names_load(tmp_path) -> None:
    """The facebook/opt-* files name OPTModel's tensors (`decoder.*`, no `model.`) and hold no lm_head (tied)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "opt", seed=7, tokenizer=False, **OPT_350M)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = {name.removeprefix("model."): tensor for name, tensor in
               load_file(model_dir / "model.safetensors").items() if name != "lm_head.weight"}
    assert "decoder.project_in.weight" in tensors
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (5, 33)], 6)


@pytest.mark.parametrize("changes", [{}, OPT_350M])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(changes, tmp_path) -> None:
    """Each rank takes its heads' rows of q / k / v and columns of out_proj and fc2; project_in / out whole."""
    model_dir = build_tiny_model(tmp_path / "opt", "opt", seed=2, tokenizer=False, **changes)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
