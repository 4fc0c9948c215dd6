"""BLOOM (ALiBi, the normed embedding, one fused per-head query_key_value): config.json read as transformers'
BloomConfig reads it, flashllm's ALiBi slopes against transformers' for every head count, the untied head, a power-of-two
head count and bloom-560m / bloom-176B's checkpoint layouts against transformers, and tensor parallelism. The tiny
preset's paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.bloom import BLOOM_CONTEXT, BloomEmbedding
from flashllm.models.gpt_neox import split_fused_qkv
from flashllm.models.hf_config import ModelLoadError, parse_hf_config, uses_alibi
from flashllm.ops.alibi_slopes import alibi_slopes
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4,
       "vocab_size": 256}


@pytest.mark.parametrize("changes", [
    {},
    # bloom-176B's names: n_embed (over hidden_size) and num_attention_heads; untied, another eps, no bos / eos
    {"n_embed": 96, "num_attention_heads": 12, "hidden_size": 32, "tie_word_embeddings": False,
     "layer_norm_epsilon": 1e-3, "bos_token_id": None, "eos_token_id": [2, 3]},
    # transformers' names win over n_layer / n_head where a config.json has both
    {"num_hidden_layers": 3, "n_layer": 5, "num_attention_heads": 8, "n_head": 2, "n_embed": None},
    # fields BloomConfig ignores: BLOOM's MLP is 4 x hidden, every head has its own key / value head
    {"intermediate_size": 100, "num_key_value_heads": 2, "n_inner": None, "pretraining_tp": 4, "slow_but_exact": True},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import BloomConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), BloomConfig(**{**RAW, **changes})
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads, ours.vocab_size) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.vocab_size)
    assert ours.intermediate_size == 4 * theirs.hidden_size and ours.num_key_value_heads == theirs.n_head
    assert ours.head_dim == theirs.hidden_size // theirs.n_head
    assert ours.rms_norm_eps == theirs.layer_norm_epsilon
    assert (ours.tie_word_embeddings, ours.bos_token_id, ours.eos_token_id) == (
        theirs.tie_word_embeddings, theirs.bos_token_id, theirs.eos_token_id)
    assert ours.attention_bias and ours.mlp_bias and ours.hidden_act == "gelu_pytorch_tanh"
    assert uses_alibi(ours) and ours.max_position_embeddings == BLOOM_CONTEXT


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import BloomConfig

    ours, theirs = parse_hf_config({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}), BloomConfig()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "bos_token_id",
                  "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == theirs.layer_norm_epsilon


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm=true"),
    ({"apply_residual_connection_post_layernorm": "no"}, "must be true or false"),
    ({"n_head": 6}, "hidden_size=64 is not divisible by num_attention_heads=6"),
    ({"n_embed": 0}, "hidden_size"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 48, 71, 112, 128])
def test_alibi_slopes_are_transformers_slopes(heads) -> None:
    """bloom-560m's 16, bloom-7b1's 32, bloom-176B's 112 (not a power of two) and more."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    torch.testing.assert_close(alibi_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu")), rtol=1e-6, atol=0)


def test_the_fused_projection_is_cut_head_by_head() -> None:
    """Rows (heads, [q | k | v], head_dim) under BLOOM's `self_attention.` name: head h's q rows sit at 3h x head_dim."""
    config = parse_hf_config(RAW)
    rows = torch.arange(3 * 64, dtype=torch.float32)
    parts = dict(split_fused_qkv([("transformer.h.0.self_attention.query_key_value.bias", rows)], config))
    assert parts["transformer.h.0.self_attention.q_proj.bias"][16:20].tolist() == [48.0, 49.0, 50.0, 51.0]
    assert parts["transformer.h.0.self_attention.k_proj.bias"][:2].tolist() == [16.0, 17.0]
    assert parts["transformer.h.0.self_attention.v_proj.bias"][-1].item() == 191.0


def _as_bloom_176b_layout(model_dir) -> None:
    """Rewrite a tiny checkpoint as the big BLOOM's files are: n_embed / num_attention_heads in config.json and,
    as bloom-560m's, tensors saved from BloomModel (no `transformer.` prefix, no lm_head)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["n_embed"], config["num_attention_heads"] = config.pop("hidden_size"), config.pop("n_head")
    path.write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    save_file({name.removeprefix("transformer."): tensor for name, tensor in tensors.items()},
              model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("variant", ["untied", "power_of_two_heads", "bloom_176b_layout"])
def test_variants_match_transformers(variant, tmp_path) -> None:
    """The preset is tied over 6 heads; an untied head, 8 heads (the geometric slopes alone) and the big checkpoints'
    config / tensor names against transformers."""
    from transformers import AutoModelForCausalLM

    changes = {"untied": {"tie_word_embeddings": False}, "power_of_two_heads": {"num_attention_heads": 8},
               "bloom_176b_layout": {}}[variant]
    model_dir = build_tiny_model(tmp_path, "bloom", seed=5, tokenizer=False, **changes)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if variant == "bloom_176b_layout":
        _as_bloom_176b_layout(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert isinstance(model.model.embed_tokens, BloomEmbedding)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (variant != "untied")
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' rows of every fused query_key_value, and its heads' slopes."""
    model_dir = build_tiny_model(tmp_path / "bloom", "bloom", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
