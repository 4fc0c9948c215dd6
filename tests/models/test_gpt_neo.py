"""GPT-Neo (GPT-2's block with separate unbiased q / k / v, unscaled scores and global / local layers): config.json
read as transformers' GPTNeoConfig reads it, all-global and all-local stacks and an untied head against transformers,
the checkpoints' mask buffers, and tensor parallelism. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.gpt_neo import GPTNeoAttention
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["GPTNeoForCausalLM"], "model_type": "gpt_neo", "hidden_size": 64, "num_layers": 4,
       "num_heads": 4, "vocab_size": 256, "max_position_embeddings": 512,
       "attention_types": [[["global", "local"], 2]], "window_size": 8}


@pytest.mark.parametrize("changes", [
    {}, {"intermediate_size": 96, "layer_norm_epsilon": 1e-3, "activation_function": "gelu", "window_size": 3,
         "attention_types": [[["local"], 1], [["global"], 3]], "tie_word_embeddings": False},
    {"num_hidden_layers": 2, "num_attention_heads": 8, "num_layers": None, "num_heads": None,  # attribute_map's
     "attention_types": [[["global"], 2]], "num_key_value_heads": 1, "rope_theta": 5.0, "sliding_window": 2},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import GPTNeoConfig

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    ours, theirs = parse_hf_config(raw), GPTNeoConfig(**raw)
    for field in ("vocab_size", "hidden_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                  "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_hidden_layers, ours.num_attention_heads) == (theirs.num_layers, theirs.num_heads)
    assert ours.intermediate_size == (theirs.intermediate_size or 4 * theirs.hidden_size)
    assert (ours.hidden_act, ours.rms_norm_eps) == (theirs.activation_function, theirs.layer_norm_epsilon)
    assert ours.num_key_value_heads == theirs.num_heads and ours.head_dim == theirs.hidden_size // theirs.num_heads
    assert ours.sliding_windows == tuple(theirs.window_size if kind == "local" else None
                                         for kind in theirs.attention_layers)


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import GPTNeoConfig

    ours, theirs = parse_hf_config({"architectures": ["GPTNeoForCausalLM"], "model_type": "gpt_neo"}), GPTNeoConfig()
    for field in ("vocab_size", "hidden_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_hidden_layers, ours.num_attention_heads) == (theirs.num_layers, theirs.num_heads)
    assert (ours.intermediate_size, ours.hidden_act) == (4 * theirs.hidden_size, theirs.activation_function)
    assert ours.rms_norm_eps == theirs.layer_norm_epsilon
    assert ours.sliding_windows == tuple(256 if kind == "local" else None for kind in theirs.attention_layers)
    assert ours.sliding_windows[:2] == (None, 256)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"activation_function": "swish"}, "hidden_act='swish' is not supported"),
    ({"attention_types": [["global", 4]]}, "must be a list of"),
    ({"attention_types": [[["global", "sparse"], 2]]}, "the kind 'sparse'"),
    ({"attention_types": [[["global", "local"], 1]]}, "expands to 2 layers but num_layers is 4"),
    ({"window_size": 0}, "window_size=0 must be a positive int"),
    ({"hidden_size": 66}, "not divisible by num_attention_heads=4"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "GPT-Neo loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("changes", [
    {"attention_types": [[["global"], 2]], "tie_word_embeddings": False, "activation_function": "gelu"},
    {"attention_types": [[["local"], 2]], "window_size": 5, "intermediate_size": None},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset alternates a global and a local layer; every layer global under an untied head with exact GELU,
    and every layer local (window 5) with the 4 x hidden MLP."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gpt_neo", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    attns = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(attn, GPTNeoAttention) and attn.attn.scale == 1.0 for attn in attns)
    assert all(attn.qkv_proj.bias is None and attn.o_proj.bias is not None for attn in attns)
    local = changes["attention_types"][0][0] == ["local"]
    assert [attn.attn.sliding_window for attn in attns] == [5 if local else None] * 2
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == changes.get("tie_word_embeddings", True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_the_mask_buffers_of_older_checkpoints_are_skipped(tmp_path) -> None:
    """EleutherAI's files keep each layer's causal (or local) mask `attn.attention.bias` and `masked_bias`."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gpt_neo", seed=7, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = load_file(model_dir / "model.safetensors")
    for layer in range(2):
        tensors[f"transformer.h.{layer}.attn.attention.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        tensors[f"transformer.h.{layer}.attn.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (5, 33)], 6)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' rows of q / k / v (a local layer's window on every rank's heads)."""
    model_dir = build_tiny_model(tmp_path / "neo", "gpt_neo", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
