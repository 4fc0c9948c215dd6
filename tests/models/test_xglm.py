"""XGLM (OPT's pre-norm block with sinusoidal positions at offset 2 and embeddings x sqrt(d_model)): config.json read
as transformers' XGLMConfig reads it, the sinusoidal table against transformers', unscaled embeddings with a zeroed
pad row inside the positions, a wider d_model and an untied head against transformers, and tensor parallelism. The
tiny preset's paged-forward and engine parity with transformers run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.xglm import SinusoidalPositionEmbedding
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["XGLMForCausalLM"], "model_type": "xglm", "d_model": 64, "num_layers": 2,
       "attention_heads": 4, "ffn_dim": 96, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.mark.parametrize("changes", [
    {}, {"scale_embedding": False, "activation_function": "relu", "tie_word_embeddings": False, "pad_token_id": 5},
    {"hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6, "d_model": None, "num_layers": None,
     "attention_heads": None, "do_layer_norm_before": False, "enable_bias": False},  # the last two: not XGLM's
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import XGLMConfig

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    ours, theirs = parse_hf_config(raw), XGLMConfig(**raw)
    for field in ("vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads) == (
        theirs.d_model, theirs.num_layers, theirs.attention_heads)
    assert (ours.intermediate_size, ours.hidden_act) == (theirs.ffn_dim, theirs.activation_function)
    assert ours.attention_bias and ours.raw["do_layer_norm_before"] and ours.num_key_value_heads == theirs.attention_heads
    assert (ours.raw["scale_embedding"], ours.raw["pad_token_id"]) == (theirs.scale_embedding, theirs.pad_token_id)


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import XGLMConfig

    ours, theirs = parse_hf_config({"architectures": ["XGLMForCausalLM"], "model_type": "xglm"}), XGLMConfig()
    for field in ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads) == (
        theirs.d_model, theirs.num_layers, theirs.attention_heads)
    assert (ours.intermediate_size, ours.hidden_act) == (theirs.ffn_dim, theirs.activation_function)
    assert (ours.raw["scale_embedding"], ours.raw["pad_token_id"]) == (theirs.scale_embedding, theirs.pad_token_id)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"activation_function": "swish"}, "hidden_act='swish' is not supported"),
    ({"scale_embedding": "yes"}, "scale_embedding='yes' must be true or false"),
    ({"add_cross_attention": True}, "add_cross_attention=true"),
    ({"d_model": 66}, "not divisible by num_attention_heads=4"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "XGLM loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize(("dim", "pad"), [(64, 1), (63, 5), (64, None)])
def test_the_sinusoidal_table_is_transformers(dim, pad) -> None:
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    theirs = XGLMSinusoidalPositionalEmbedding(40, dim, pad)
    ours = SinusoidalPositionEmbedding(40, dim, pad, torch.float32, torch.device("cpu"))
    positions = torch.arange(40)
    torch.testing.assert_close(ours(positions), theirs(positions.unsqueeze(0))[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("changes", [
    {"scale_embedding": False, "pad_token_id": 5, "tie_word_embeddings": False},
    {"hidden_size": 96, "num_attention_heads": 6, "activation_function": "relu"},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset scales its embeddings; unscaled ones with position 3 reading the zeroed pad row under an untied
    head, and a wider d_model (more frequencies) with ReLU."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "xglm", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert (type(model.model.embed_tokens) is VocabEmbedding) == (not changes.get("scale_embedding", True))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == changes.get("tie_word_embeddings", True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' rows of q / k / v; the sinusoidal table is whole on each."""
    model_dir = build_tiny_model(tmp_path / "xglm", "xglm", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
