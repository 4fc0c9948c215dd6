"""GPTBigCode (StarCoder 1: learned absolute positions, multi-query attention fused with the queries in one c_attn,
biased LayerNorms and MLP): config.json read as transformers' GPTBigCodeConfig reads it, multi-head attention, the
unscaled scores and an untied head against transformers, the fused tensor's row order in both layouts, and tensor
parallelism. The tiny preset's paged-forward and engine parity with transformers run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.gpt_bigcode import FUSED_C_ATTN, GPTBigCodeModel
from flashllm.models.gpt_neox import split_fused_qkv
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "n_embd": 64, "n_layer": 2,
       "n_head": 4, "vocab_size": 256, "n_positions": 512}


@pytest.mark.parametrize("changes", [
    {}, {"multi_query": False, "n_inner": 96, "layer_norm_epsilon": 1e-3, "activation_function": "gelu_fast"},
    {"scale_attn_weights": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
     "num_key_value_heads": 2, "intermediate_size": 100, "head_dim": 8},  # the last three: not GPTBigCode's fields
    {"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 3, "max_position_embeddings": 64,
     "n_embd": None, "n_head": None, "n_layer": None, "n_positions": None},  # the generic names (attribute_map)
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import GPTBigCodeConfig

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    ours, theirs = parse_hf_config(raw), GPTBigCodeConfig(**raw)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.intermediate_size == (theirs.n_inner or 4 * theirs.n_embd)
    assert (ours.hidden_act, ours.rms_norm_eps) == (theirs.activation_function, theirs.layer_norm_epsilon)
    assert ours.num_key_value_heads == (1 if theirs.multi_query else theirs.n_head)
    assert ours.head_dim == theirs.n_embd // theirs.n_head
    assert ours.raw["scale_attn_weights"] == theirs.scale_attn_weights
    assert ours.attention_bias and ours.mlp_bias


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import GPTBigCodeConfig

    ours = parse_hf_config({"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode"})
    theirs = GPTBigCodeConfig()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.intermediate_size, ours.num_key_value_heads, ours.head_dim) == (4 * 768, 1, 64)
    assert (ours.hidden_act, ours.rms_norm_eps) == (theirs.activation_function, theirs.layer_norm_epsilon)
    assert ours.raw["scale_attn_weights"] is theirs.scale_attn_weights is True


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"activation_function": "silu"}, "hidden_act='silu' is not supported"),
    ({"multi_query": "yes"}, "multi_query='yes' must be true or false"),
    ({"scale_attn_weights": 1}, "scale_attn_weights=1 must be true or false"),
    ({"n_head": 5}, "not divisible by num_attention_heads=5"),
    ({"n_inner": 0}, "intermediate_size"),
    ({"add_cross_attention": True}, "add_cross_attention=true"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize(("multi_query", "q_rows", "k_rows", "v_rows"), [
    (True, range(0, 64), range(64, 80), range(80, 96)),  # [q (n_embd) | k (head_dim) | v (head_dim)]
    # head by head: head h's q, k and v rows at 48h, 48h + 16, 48h + 32
    (False, [48 * h + i for h in range(4) for i in range(16)], [48 * h + 16 + i for h in range(4) for i in range(16)],
     [48 * h + 32 + i for h in range(4) for i in range(16)]),
])
def test_the_fused_projection_is_cut_as_transformers_views_it(multi_query, q_rows, k_rows, v_rows) -> None:
    config = parse_hf_config({**RAW, "multi_query": multi_query})
    rows = torch.arange(64 + 2 * 16 * config.num_key_value_heads, dtype=torch.float32)
    parts = dict(split_fused_qkv([("transformer.h.1.attn.c_attn.bias", rows)], config, FUSED_C_ATTN))
    assert parts["transformer.h.1.attn.q_proj.bias"].tolist() == list(map(float, q_rows))
    assert parts["transformer.h.1.attn.k_proj.bias"].tolist() == list(map(float, k_rows))
    assert parts["transformer.h.1.attn.v_proj.bias"].tolist() == list(map(float, v_rows))
    with pytest.raises(ModelLoadError, match="has 95 rows"):
        list(split_fused_qkv([("transformer.h.0.attn.c_attn.weight", torch.zeros(95, 64))], config, FUSED_C_ATTN))


@pytest.mark.parametrize("changes", [
    {"multi_query": False},
    {"scale_attn_weights": False, "tie_word_embeddings": False, "activation_function": "gelu_fast", "n_inner": None},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset is StarCoder's multi-query attention with a tied head; multi-head attention (its per-head c_attn
    layout), and scores left unscaled with an untied head, tanh GELU written out and the default 4 x n_embd MLP."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gpt_bigcode", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert isinstance(model.model, GPTBigCodeModel)
    attn = model.model.layers[0].self_attn
    assert attn.num_kv_heads == (1 if changes.get("multi_query", True) else 4)
    assert attn.attn.scale == (0.25 if changes.get("scale_attn_weights", True) else 1.0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == changes.get("tie_word_embeddings", True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


@pytest.mark.parametrize("changes", [{}, {"multi_query": False}])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(changes, tmp_path) -> None:
    """Each rank takes its query heads' rows of every fused c_attn (the one key / value head on both)."""
    model_dir = build_tiny_model(tmp_path / "bigcode", "gpt_bigcode", seed=2, tokenizer=False, **changes)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
