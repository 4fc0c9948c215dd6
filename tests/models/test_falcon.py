"""Falcon (the 7B multi-query parallel block, the 40B / 180B new decoder architecture, Falcon2-11B's one-norm variant,
Falcon-RW's ALiBi sequential block): config.json read as transformers' FalconConfig reads it, the refusals, the fused
query_key_value's group-by-group row order, every layout against transformers, and tensor parallelism. The tiny
preset (the new decoder architecture) runs paged-forward and engine parity with transformers in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.falcon import FalconAlibiAttention
from flashllm.models.gpt_neox import GPTNeoXParallelLayer, split_fused_qkv
from flashllm.models.hf_config import ModelLoadError, parse_hf_config, uses_alibi
from flashllm.models.llama import LlamaAttention
from flashllm.models.starcoder2 import Starcoder2DecoderLayer
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "vocab_size": 256}
# the layouts of the published checkpoints, at tiny sizes (the preset is the new decoder architecture's)
FALCON_7B = {"new_decoder_architecture": False}  # multi_query, parallel_attn: FalconConfig's defaults
FALCON_RW = {"new_decoder_architecture": False, "multi_query": False, "parallel_attn": False, "alibi": True,
             "bias": True, "num_kv_heads": None}
FALCON2_11B = {"num_ln_in_parallel_attn": 1, "rope_theta": 500042.0}


def _effective_kv_heads(theirs) -> int:
    """The key / value heads transformers' FalconAttention projects."""
    if theirs.new_decoder_architecture:
        return theirs.num_kv_heads
    return 1 if theirs.multi_query else theirs.num_attention_heads


@pytest.mark.parametrize("changes", [
    {}, FALCON_7B, FALCON_RW, {**FALCON_RW, "num_kv_heads": 4},
    {"new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": True, **FALCON2_11B},
    {"new_decoder_architecture": True, "num_kv_heads": 1, "bias": True, "tie_word_embeddings": False},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "layer_norm_epsilon": 1e-3, "activation": "gelu_new",
     "ffn_hidden_size": 96, "max_position_embeddings": 4096},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}, "multi_query": False,
     "intermediate_size": 128, "num_key_value_heads": 2, "rms_norm_eps": 0.1, "hidden_act": "relu"},
    {"n_embed": 128, "alibi": True, "rope_theta": 7.0},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconDecoderLayer

    raw = {**RAW, **changes}
    ours, theirs = parse_hf_config(raw), FalconConfig(**raw)
    assert (ours.hidden_size, ours.intermediate_size, ours.num_attention_heads, ours.head_dim) == (
        theirs.hidden_size, theirs.ffn_hidden_size, theirs.num_attention_heads, theirs.head_dim)
    assert ours.num_key_value_heads == _effective_kv_heads(theirs)
    assert ours.rms_norm_eps == theirs.layer_norm_epsilon and ours.hidden_act == theirs.activation
    assert ours.attention_bias == ours.mlp_bias == theirs.bias
    assert ours.alibi == theirs.alibi == uses_alibi(ours)
    assert (ours.tie_word_embeddings, ours.max_position_embeddings, ours.vocab_size) == (
        theirs.tie_word_embeddings, theirs.max_position_embeddings, theirs.vocab_size)
    if not theirs.alibi:
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rotary_dim == theirs.head_dim
        assert (ours.rope_scaling or {}).get("rope_type", "default") == theirs.rope_parameters["rope_type"]
    # the block: which norms transformers' decoder layer builds, and whether its branches run in parallel
    theirs._attn_implementation = "eager"
    layer = FalconDecoderLayer(theirs, layer_idx=0)
    assert hasattr(layer, "ln_attn") == (ours.parallel_attn and ours.num_ln_in_parallel_attn == 2)
    assert hasattr(layer, "post_attention_layernorm") == (not ours.parallel_attn)
    assert ours.parallel_attn == (theirs.parallel_attn or theirs.new_decoder_architecture)


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import FalconConfig

    ours, theirs = parse_hf_config({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}), FalconConfig()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "tie_word_embeddings", "alibi"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.intermediate_size, ours.head_dim, ours.num_key_value_heads) == (theirs.ffn_hidden_size, 64, 1)
    assert (ours.rms_norm_eps, ours.hidden_act, ours.attention_bias) == (
        theirs.layer_norm_epsilon, theirs.activation, theirs.bias)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert ours.parallel_attn and ours.num_ln_in_parallel_attn == 1


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"activation": "silu"}, "hidden_act='silu' is not supported"),
    ({"new_decoder_architecture": True, "parallel_attn": False}, "cannot run it either"),
    ({"num_ln_in_parallel_attn": 2}, "two norms need new_decoder_architecture"),
    ({"new_decoder_architecture": True, "num_ln_in_parallel_attn": 3}, "must be 1 or 2"),
    ({"multi_query": False, "num_kv_heads": 2}, "one key / value head per query head"),
    ({"new_decoder_architecture": True, "num_kv_heads": 3}, "not a multiple of num_kv_heads=3"),
    ({"head_dim": 32}, "is not hidden_size / num_attention_heads"),
    ({"partial_rotary_factor": 0.5}, "Falcon turns whole heads"),
    ({"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
    ({"alibi": "yes"}, "alibi='yes' must be true or false"),
    ({"rope_scaling": [1, 2]}, "must be an object or null"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


def test_the_fused_projection_is_cut_group_by_group() -> None:
    """new_decoder_architecture's rows (kv_heads, [q heads of the group | k | v], head_dim): 2 groups of 2 query heads
    of 16 features, so group g's q rows start at 64 g, its k at 64 g + 32 and its v at 64 g + 48."""
    config = parse_hf_config({**RAW, "new_decoder_architecture": True, "num_kv_heads": 2})
    rows = torch.arange(128, dtype=torch.float32)
    parts = dict(split_fused_qkv([("transformer.h.0.self_attention.query_key_value.bias", rows)], config))
    prefix = "transformer.h.0.self_attention"
    assert parts[f"{prefix}.q_proj.bias"][[0, 31, 32, 63]].tolist() == [0.0, 31.0, 64.0, 95.0]
    assert parts[f"{prefix}.k_proj.bias"][[0, 16]].tolist() == [32.0, 96.0]
    assert parts[f"{prefix}.v_proj.bias"][[0, 31]].tolist() == [48.0, 127.0]
    # Falcon-7B's multi-query rows are one group: [all q | k | v]
    mqa = dict(split_fused_qkv([(f"{prefix}.query_key_value.bias", rows[:96])], parse_hf_config(RAW)))
    assert mqa[f"{prefix}.k_proj.bias"][0].item() == 64.0 and mqa[f"{prefix}.v_proj.bias"][-1].item() == 95.0
    with pytest.raises(ModelLoadError, match="has 100 rows"):
        list(split_fused_qkv([(f"{prefix}.query_key_value.weight", torch.zeros(100, 64))], config))


@pytest.mark.parametrize(("changes", "norms"), [
    (FALCON_7B, 1),
    (FALCON_RW, "sequential"),
    ({**FALCON_RW, "hidden_size": 96, "num_attention_heads": 6}, "sequential"),
    ({**FALCON2_11B, "bias": True, "activation": "gelu_new"}, 1),
    ({**FALCON_7B, "alibi": True, "tie_word_embeddings": False}, 1),
    ({"num_kv_heads": 1, "alibi": True, "bias": True}, 2),
])
def test_variants_match_transformers(changes, norms, tmp_path) -> None:
    """Falcon-7B's multi-query block; Falcon-RW's ALiBi sequential block with biases (4 heads, and 6: slopes from
    two geometric sequences); Falcon2-11B's one-norm new architecture; ALiBi in both parallel blocks (transformers
    divides the bias by sqrt(head_dim) too); an untied head; the preset itself runs in the parity files."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "falcon", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    layer = model.model.layers[0]
    if norms == "sequential":
        assert type(layer) is Starcoder2DecoderLayer
    else:
        assert type(layer) is GPTNeoXParallelLayer and (layer.post_attention_layernorm is not None) == (norms == 2)
    assert type(layer.self_attn) is (FalconAlibiAttention if changes.get("alibi") else LlamaAttention)
    assert (layer.self_attn.o_proj.bias is not None) == changes.get("bias", False)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == changes.get("tie_word_embeddings", True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


@pytest.mark.parametrize("changes", [{}, FALCON_7B, FALCON_RW])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(changes, tmp_path) -> None:
    """Each rank takes its query heads' rows of every fused query_key_value (and its heads' ALiBi slopes); Falcon-7B's
    one key / value head is replicated on both."""
    model_dir = build_tiny_model(tmp_path / "falcon", "falcon", seed=2, tokenizer=False, **changes)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
