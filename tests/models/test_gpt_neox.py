"""GPT-NeoX (Pythia: the parallel residual over two LayerNorms, one fused per-head query_key_value, RoPE over a
quarter of each head): config.json read as transformers' GPTNeoXConfig reads it, the sequential residual and the
bias-free attention against transformers, the fused tensor's per-head row order, and tensor parallelism. The tiny
preset's paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.gpt_neox import GPTNeoXParallelLayer, split_fused_qkv
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.starcoder2 import Starcoder2DecoderLayer
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64,
       "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}


@pytest.mark.parametrize("changes", [
    {}, {"rotary_pct": 0.5, "rotary_emb_base": 500, "layer_norm_eps": 1e-3, "use_parallel_residual": False},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 1.0},
     "attention_bias": False, "tie_word_embeddings": True, "hidden_act": "gelu_new", "max_position_embeddings": 4096},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rotary_pct": 0.25},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import GPTNeoXConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), GPTNeoXConfig(**{**RAW, **changes})
    head_dim = theirs.hidden_size // theirs.num_attention_heads
    assert ours.rotary_dim == int(head_dim * theirs.rope_parameters["partial_rotary_factor"])
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.layer_norm_eps
    assert (ours.tie_word_embeddings, ours.hidden_act, ours.max_position_embeddings) == (
        theirs.tie_word_embeddings, theirs.hidden_act, theirs.max_position_embeddings)
    assert ours.attention_bias == theirs.attention_bias and ours.mlp_bias
    assert ours.num_key_value_heads == theirs.num_attention_heads
    assert ours.raw.get("use_parallel_residual", True) == theirs.use_parallel_residual


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import GPTNeoXConfig

    ours, theirs = parse_hf_config({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}), GPTNeoXConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings", "hidden_act",
                  "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == theirs.layer_norm_eps
    assert ours.rotary_dim == int(96 * theirs.rope_parameters["partial_rotary_factor"]) == 24


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ({"use_parallel_residual": "yes"}, "use_parallel_residual='yes' must be true or false"),
    ({"head_dim": 32}, "is not hidden_size=64"),
    ({"rope_scaling": [1, 2]}, "must be an object or null"),
    ({"rotary_pct": 1.5}, "1.5"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


def test_the_fused_projection_is_cut_head_by_head() -> None:
    """Rows (heads, [q | k | v], head_dim): head h's q rows sit at 3h x head_dim, not in the first third."""
    config = parse_hf_config(RAW)
    rows = torch.arange(3 * 64, dtype=torch.float32)
    parts = dict(split_fused_qkv([("gpt_neox.layers.0.attention.query_key_value.bias", rows)], config))
    assert parts["gpt_neox.layers.0.attention.q_proj.bias"][16:20].tolist() == [48.0, 49.0, 50.0, 51.0]
    assert parts["gpt_neox.layers.0.attention.k_proj.bias"][:2].tolist() == [16.0, 17.0]
    assert parts["gpt_neox.layers.0.attention.v_proj.bias"][-1].item() == 191.0
    with pytest.raises(ModelLoadError, match="has 190 rows"):
        list(split_fused_qkv([("gpt_neox.layers.0.attention.query_key_value.weight", torch.zeros(190, 64))], config))


@pytest.mark.parametrize("changes", [{"use_parallel_residual": False}, {"attention_bias": False},
                                     {"tie_word_embeddings": True, "rotary_pct": 1.0}])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset is Pythia's parallel residual with biases; the sequential residual (some fine-tunes), attention
    without biases, and a tied head over full-head RoPE against transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gpt_neox", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    layer = model.model.layers[0]
    parallel = changes.get("use_parallel_residual", True)
    assert isinstance(layer, GPTNeoXParallelLayer if parallel else Starcoder2DecoderLayer)
    assert (layer.self_attn.o_proj.bias is not None) == changes.get("attention_bias", True)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(changes.get("tie_word_embeddings"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


@pytest.mark.parametrize("changes", [{}, {"use_parallel_residual": False}])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(changes, tmp_path) -> None:
    """Each rank takes its heads' rows of every fused query_key_value."""
    model_dir = build_tiny_model(tmp_path / "neox", "gpt_neox", seed=2, tokenizer=False, **changes)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
