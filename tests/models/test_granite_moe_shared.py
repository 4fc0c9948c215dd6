"""IBM Granite-MoE-Shared (transformers' GraniteMoeSharedForCausalLM: Granite-MoE with an ungated shared MLP beside the
experts): config.json read as GraniteMoeSharedConfig reads it, paged prefill / decode and the engine's greedy tokens
against transformers on a tiny checkpoint (and with shared_intermediate_size 0), the fused shared input_linear cut
gate-first, two tensor-parallel and two expert-parallel ranks; pre-quantized checkpoints refused."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.granite_moe import GraniteMoeSharedForCausalLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, check_varlen_prefill_and_decode, random_tokens
from flashllm.testing.tiny_moe import GRANITE_MOE_SHARED_PRESET, MOE_BASE, build_moe_model

VOCAB = MOE_BASE["vocab_size"]
ATOL = 1e-4
MODEL_TYPE, ARCH, FIELDS = GRANITE_MOE_SHARED_PRESET
RAW = {"architectures": [ARCH], "model_type": MODEL_TYPE, **MOE_BASE, **FIELDS}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(transformers GraniteMoeSharedForCausalLM, its directory)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path_factory.mktemp("granitemoeshared"), "granitemoeshared", seed=7)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), model_dir


@pytest.mark.parametrize("changes", [{}, {"shared_intermediate_size": 0, "attention_bias": True},
                                     {"shared_intermediate_size": None, "num_local_experts": 8,
                                      "num_experts_per_tok": 3, "tie_word_embeddings": False}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import GraniteMoeSharedConfig

    raw = {key: value for key, value in {**RAW, **changes}.items() if value is not None}
    ours, theirs = parse_hf_config(raw), GraniteMoeSharedConfig(**raw)
    assert ours.shared_expert_intermediate_size == theirs.shared_intermediate_size
    assert (ours.num_experts, ours.num_experts_per_tok) == (theirs.num_local_experts, theirs.num_experts_per_tok)
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                  "attention_bias", "tie_word_embeddings", "num_key_value_heads", "intermediate_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.moe_intermediate_size == theirs.intermediate_size


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import GraniteMoeSharedConfig

    # the sizes are required (as for every Llama-shaped family); the rest take transformers' defaults
    sizes = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "vocab_size": 32000}
    ours = parse_hf_config({"architectures": [ARCH], "model_type": MODEL_TYPE, **sizes})
    theirs = GraniteMoeSharedConfig()
    assert ours.shared_expert_intermediate_size == theirs.shared_intermediate_size == 0
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                  "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                  "bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.num_experts, ours.num_experts_per_tok) == (theirs.num_local_experts, theirs.num_experts_per_tok)


def test_varlen_prefill_and_decode_match_transformers(shared, ops, model_registry, paged_driver) -> None:
    hf_model, model_dir = shared
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert type(ours) is GraniteMoeSharedForCausalLM
    block = ours.model.layers[0].mlp
    assert block.shared_expert is not None and block.shared_expert_gate is None
    gate, _ = hf_model.model.layers[0].shared_mlp.input_linear.weight.chunk(2)  # gate rows first
    torch.testing.assert_close(block.shared_expert.gate_up_proj.weight[:80], gate, atol=0, rtol=0)
    driver = paged_driver(ours, block_size=16, num_blocks=64, seed=3)
    check_varlen_prefill_and_decode(driver, hf_model, [random_tokens(n, VOCAB, seed=100 + n) for n in (1, 9, 70)],
                                    ATOL)


def test_engine_greedy_tokens_and_logits_match_transformers(shared) -> None:
    hf_model, model_dir = shared
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (3, 40)], 12, ATOL)


def test_no_shared_mlp_matches_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path, "granitemoeshared", seed=3, shared_intermediate_size=0)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=32)
    assert llm.engine.parts.model.model.layers[0].mlp.shared_expert is None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, VOCAB, seed=n) for n in (5, 20)], 8, ATOL)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(shared, options) -> None:
    """Tensor parallel: each rank its half of the shared MLP's gate and up rows; expert parallel: two whole experts
    each, the shared MLP still split."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=50 + n) for n in (5, 40)], shared[1], **options)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}},
     "pre-quantized GraniteMoeSharedForCausalLM checkpoints are not supported"),
    ({"shared_intermediate_size": -8}, "shared_intermediate_size=-8 must be a positive int"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({**RAW, **changes})
    assert fragment in str(info.value) and "\n" not in str(info.value)
