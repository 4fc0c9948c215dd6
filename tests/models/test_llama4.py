"""Llama 4 text (Llama4ForCausalLM, and Llama4ForConditionalGeneration served text-only): config.json read as
transformers' Llama4TextConfig reads it (Scout's and Maverick's shapes, defaults, the lists that pick NoPE, MoE and
chunked layers), the refusals, the variants (top-2, no qk norm, biased attention, no chunking, chunked NoPE layers)
against transformers with prompts longer than the 64-token chunks, the text-only VLM in both checkpoint layouts, and
two tensor-parallel and two expert-parallel ranks. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.core.runner_select import EngineConfigError
from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.llama4 import Llama4MoE
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model
from flashllm.testing.tiny_vlm import build_tiny_vlm

VOCAB = 256
PROMPTS = [random_tokens(n, VOCAB, seed=n) for n in (3, 40, 150)]  # 150 spans three 64-token chunks
RAW = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 48,
       "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "vocab_size": VOCAB, "num_local_experts": 4}
# Scout's text_config fields (4 layers), extras transformers does not read included
SCOUT = {"attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": True, "floor_scale": 8192,
         "interleave_moe_layer_step": 1, "moe_layers": [0, 1, 2, 3], "no_rope_layers": [1, 1, 1, 0],
         "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_qk_norm": True,
         "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "for_llm_compressor": False, "cache_implementation": "hybrid", "pad_token_id": 0}
# Maverick's: MoE every other layer, no qk norm, plain RoPE
MAVERICK = {"interleave_moe_layer_step": 2, "moe_layers": [1, 3], "use_qk_norm": False, "rope_scaling": None,
            "no_rope_layers": [1, 1, 1, 0], "max_position_embeddings": 1048576, "num_local_experts": 8}
OTHER = {"moe_layers": None, "interleave_moe_layer_step": 2, "attention_chunk_size": None, "head_dim": 32,
         "attention_bias": True, "num_experts_per_tok": 2, "attn_temperature_tuning": False,
         "no_rope_layer_interval": 2, "tie_word_embeddings": True}
TYPED = {"layer_types": ["chunked_attention", "full_attention", "chunked_attention", "full_attention"],
         "no_rope_layers": [0, 1, 1, 1], "attention_chunk_size": 32}


def _check_reads_as(ours, theirs) -> None:
    """Every field flashllm reads against transformers' Llama4TextConfig `theirs`."""
    layers = theirs.num_hidden_layers
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size,
            ours.shared_expert_intermediate_size, ours.intermediate_size) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size, theirs.intermediate_size,
        theirs.intermediate_size_mlp)
    assert ours.sparse_layers == tuple(i in theirs.moe_layers for i in range(layers))
    assert ours.rope_layers == tuple(bool(theirs.no_rope_layers[i]) for i in range(layers))
    assert ours.chunked_layers == tuple(kind == "chunked_attention" for kind in theirs.layer_types)
    for field in ("attention_chunk_size", "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale",
                  "head_dim", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                  "hidden_act", "vocab_size", "bos_token_id", "eos_token_id", "hidden_size", "num_hidden_layers"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.qkv_bias == theirs.attention_bias
    rope = theirs.rope_parameters
    assert ours.rope_theta == rope["rope_theta"]
    assert (ours.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    assert ours.rope_interleaved and not ours.norm_topk_prob


@pytest.mark.parametrize("changes", [{}, SCOUT, MAVERICK, OTHER, TYPED], ids=["tiny", "scout", "maverick", "other",
                                                                         "layer_types"])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import Llama4TextConfig

    raw = {**RAW, **changes}
    _check_reads_as(parse_hf_config(raw), Llama4TextConfig(**raw))


def test_fields_left_out_take_llama4textconfig_defaults() -> None:
    from transformers import Llama4TextConfig

    raw = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text"}
    _check_reads_as(parse_hf_config(raw), Llama4TextConfig(**raw))


def test_the_published_integer_temperature_flag_reads_as_on() -> None:
    """Scout's and Maverick's files write attn_temperature_tuning 4 (transformers 4.51 read it as on; 5.25's strict
    config refuses it)."""
    assert parse_hf_config({**RAW, "attn_temperature_tuning": 4}).attn_temperature_tuning
    assert not parse_hf_config({**RAW, "attn_temperature_tuning": 0}).attn_temperature_tuning


def test_a_vlm_text_config_reads_as_transformers_reads_it() -> None:
    """Llama4ForConditionalGeneration: text_config over Llama4TextConfig's defaults, its nulls kept (no chunking)."""
    from transformers import Llama4Config

    text = {**{k: v for k, v in RAW.items() if k != "architectures"}, **SCOUT, "attention_chunk_size": None}
    raw = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
           "tie_word_embeddings": False}
    ours = parse_hf_config(raw)
    _check_reads_as(ours, Llama4Config(text_config=text).text_config)
    assert ours.attention_chunk_size is None and not any(ours.chunked_layers)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "loads float checkpoints only"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers=.* at least num_hidden_layers=4"),
    ({"no_rope_layers": [1, 2, 1, 0]}, "must hold 0 .NoPE. or 1"),
    ({"moe_layers": [1, 4]}, "moe_layers=.* outside 0..3"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types=.*Llama 4 layers are one of"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None}, "attention_chunk_size is null"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
    ({"attention_chunk_size": 0}, "attention_chunk_size=0 must be a positive int"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"use_qk_norm": "yes"}, "use_qk_norm='yes' must be true or false"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("changes", [
    {"num_experts_per_tok": 2, "use_qk_norm": False, "attention_bias": True},
    {"attention_chunk_size": None, "moe_layers": [0, 1, 2, 3], "attn_temperature_tuning": False},
    {"layer_types": ["chunked_attention", "full_attention", "chunked_attention", "full_attention"],
     "no_rope_layers": [0, 1, 1, 1], "attention_chunk_size": 32, "head_dim": 32},
], ids=["top2_no_qk_norm_biased", "unchunked_all_moe", "chunked_nope_layer"])
def test_variants_match_transformers(changes, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "llama4", seed=6, tokenizer=False, **changes)  # no near-tied top-k
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    config, layers = model.config, model.model.layers
    assert [type(layer.mlp) is Llama4MoE for layer in layers] == list(config.sparse_layers)
    assert all(type(layer.mlp) is GatedMLP for layer, sparse in zip(layers, config.sparse_layers, strict=True)
               if not sparse)
    assert [layer.self_attn.chunk_view is not None for layer in layers] == list(config.chunked_layers)
    assert DECODER_STACK not in model.fusions()  # its own attention and MoE: no fused stack describes them
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, PROMPTS, 8, 1e-4)


@pytest.mark.parametrize("original_format", [True, False], ids=["hub", "transformers5"])
def test_the_text_only_vlm_matches_transformers_on_text(original_format, tmp_path) -> None:
    """Scout / Maverick checkpoints: `language_model.` (both layouts name it so), the vision model never loaded."""
    from transformers import AutoModelForImageTextToText

    model_dir = build_tiny_vlm(tmp_path, "llama4", seed=3, original_format=original_format)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    ours = llm.engine.parts.model
    assert not any("vision" in name or "projector" in name for name, _ in ours.named_parameters())
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, PROMPTS, 8)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' and experts' feature slices; expert parallel ranks hold 2 experts each;
    the 90-token prompt crosses a chunk boundary."""
    model_dir = build_tiny_model(tmp_path, "llama4", seed=2, tokenizer=False)
    two_ranks_decode_as_one([random_tokens(90, VOCAB, seed=9), [7, 3, 250]], model_dir, **options)


def test_a_block_size_that_does_not_divide_the_chunk_is_refused_before_anything_runs(tmp_path) -> None:
    """Blocks of 48 tokens cannot hold whole 64-token chunks: the engine refuses at build, in one line."""
    model_dir = build_tiny_model(tmp_path, "llama4", seed=2, tokenizer=False)
    with pytest.raises(EngineConfigError, match=r"^block_size 48: .*divide attention_chunk_size=64; choose"):
        LLM(str(model_dir), dtype="float32", device="cpu", block_size=48, max_model_len=256, num_kv_blocks=64)
    unchunked = build_tiny_model(tmp_path / "unchunked", "llama4", seed=2, tokenizer=False, attention_chunk_size=None)
    LLM(str(unchunked), dtype="float32", device="cpu", block_size=48, max_model_len=256, num_kv_blocks=64)
