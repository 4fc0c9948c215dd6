"""Helium (Llama's decoder with adjacent-pair RoPE and an unbiased hidden -> hidden o_proj): config.json read as
transformers' HeliumConfig reads it, the variants against transformers, the fused decoder-stack path it keeps, and
tensor parallelism. The tiny preset's paged-forward and engine parity with transformers run in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["HeliumForCausalLM"], "model_type": "helium", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 256}
# HeliumConfig's num_key_value_heads default is 20, not the head count: RAW gives it as a checkpoint would


@pytest.mark.parametrize("changes", [
    {}, {"num_key_value_heads": 2, "rope_theta": 20000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True, "mlp_bias": True,
     "max_position_embeddings": 8192, "eos_token_id": 3, "bos_token_id": 0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import HeliumConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), HeliumConfig(**{**RAW, **changes})
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.rope_interleaved
    assert (ours.rope_scaling or {}).get("factor") == theirs.rope_parameters.get("factor")
    for field in ("num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                  "mlp_bias", "max_position_embeddings", "bos_token_id", "eos_token_id", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import HeliumConfig

    ours, theirs = parse_hf_config({"architectures": ["HeliumForCausalLM"], "model_type": "helium"}), HeliumConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                  "eos_token_id", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 100000.0 and ours.rope_scaling is None


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"head_dim": 32}, "is not hidden_size=64"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("changes", [
    {"attention_bias": False, "mlp_bias": False, "num_key_value_heads": 4},
    {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset has q / k / v and MLP biases over GQA; the bias-free multi-head Helium-1 2B shape, and a tied head
    with linearly scaled RoPE, against transformers; every layer stays Llama's, so the fused stack is offered."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "helium", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.bias is None and (attn.qkv_proj.bias is not None) == changes.get("attention_bias", True)
    assert DECODER_STACK in model.fusions()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' q / k / v rows and biases and its o_proj columns."""
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], build_tiny_model(tmp_path / "helium", "helium", seed=2,
                                                                    tokenizer=False))
