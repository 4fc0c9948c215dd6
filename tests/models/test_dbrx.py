"""DBRX (DbrxForCausalLM) against transformers on tiny random checkpoints in the Hub's layout (bias-free LayerNorms,
one Wqkv clamped to clip_qkv over grouped keys, experts as three (E * I, H) tensors per layer, top-k weights divided
by their p-norm): varlen prefill and decode over the paged cache, the engine's greedy tokens and logits, the routing
variants, two tensor-parallel and two expert-parallel ranks; configs (nested attn_config / ffn_config) read as
transformers' DbrxConfig reads them, and what flashllm cannot run refused in one line."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.dbrx import BiasFreeLayerNorm, DbrxForCausalLM, DbrxSparseMoeBlock
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, check_varlen_prefill_and_decode, random_tokens
from flashllm.testing.tiny_moe import DBRX_PRESET, MOE_BASE, build_moe_model

VOCAB = MOE_BASE["vocab_size"]
PROMPT_LENGTHS = (1, 7, 63, 65, 130)
ATOL = 1e-4
RAW = {"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 2,
       "vocab_size": 256, "max_seq_len": 512}
# databricks/dbrx-instruct's config.json fields (sizes shrunk)
INSTRUCT = {"attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "model_type": "", "rope_theta": 500000},
            "ffn_config": {"ffn_hidden_size": 48, "model_type": "", "moe_jitter_eps": 0.01, "moe_loss_weight": 0.05,
                           "moe_num_experts": 16, "moe_top_k": 4},
            "emb_pdrop": 0.0, "resid_pdrop": 0.0, "router_aux_loss_coef": 0.05, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "output_router_logits": False, "initializer_range": 0.02}


@pytest.fixture(scope="module")
def dbrx(tmp_path_factory):
    """(transformers DbrxForCausalLM, its directory)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path_factory.mktemp("dbrx"), "dbrx", seed=3)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), model_dir


def test_the_model_has_bias_free_norms_clamped_qkv_and_normed_weights(dbrx, ops, model_registry) -> None:
    ours, _ = load_model(dbrx[1], ops, torch.float32, "cpu", model_registry, progress=False)
    first = ours.model.layers[0]
    assert type(ours) is DbrxForCausalLM and type(first.mlp) is DbrxSparseMoeBlock and first.mlp.norm_p == 1.0
    assert type(first.input_layernorm) is BiasFreeLayerNorm and first.input_layernorm.bias is None
    assert first.self_attn.clip_qkv == 0.8 and first.self_attn.num_kv_heads == 2
    assert ours.config.rope_theta == 500000.0
    assert DECODER_STACK not in ours.fusions()


def test_varlen_prefill_and_decode_match_transformers(dbrx, ops, model_registry, paged_driver) -> None:
    hf_model, model_dir = dbrx
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=16, num_blocks=64, seed=3)
    check_varlen_prefill_and_decode(driver, hf_model, [random_tokens(n, VOCAB, seed=100 + n) for n in PROMPT_LENGTHS],
                                    ATOL)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(dbrx, backend) -> None:
    hf_model, model_dir = dbrx
    llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=256,
              num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (1, 40, 100)], 6, ATOL)


@pytest.mark.parametrize("ffn", [{"moe_normalize_expert_weights": None, "moe_top_k": 3},
                                 {"moe_normalize_expert_weights": 2.0, "moe_top_k": 3, "moe_num_experts": 8},
                                 {"moe_top_k": 1}])
def test_routing_variants_match_transformers(ffn, tmp_path) -> None:
    """Weights as scored, divided by their 2-norm, and top-1 (a weight of one); a bound no value reaches (transformers
    5.25 cannot run clip_qkv null: it calls clamp with neither bound), one KV head."""
    from transformers import AutoModelForCausalLM

    attn = {"kv_n_heads": 1, "clip_qkv": 100.0, "rope_theta": 500000.0}
    model_dir = build_moe_model(tmp_path, "dbrx", seed=4, attn_config=attn,
                                ffn_config={**DBRX_PRESET[2]["ffn_config"], **ffn})
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    assert llm.engine.parts.model.model.layers[0].self_attn.clip_qkv == 100.0
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (5, 70)], 6, ATOL)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(dbrx, options) -> None:
    """Tensor parallel ranks take their heads' Wqkv rows and each expert's feature slice of w1 / v1 / w2; expert
    parallel ranks hold 2 experts each."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=60 + n) for n in (5, 40)], dbrx[1], **options)


@pytest.mark.parametrize("changes", [{}, INSTRUCT, {"rope_theta": 20000.0, "attn_config": {"kv_n_heads": 4}},
                                     {"ffn_config": {"moe_normalize_expert_weights": None, "moe_num_experts": 8,
                                                     "moe_top_k": 8, "ffn_act_fn": {"name": "silu"}},
                                      "bos_token_id": 1, "eos_token_id": 2}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import DbrxConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), DbrxConfig(**{**RAW, **changes})
    attn, ffn = theirs.attn_config, theirs.ffn_config
    assert (ours.hidden_size, ours.num_attention_heads, ours.num_hidden_layers, ours.max_position_embeddings,
            ours.vocab_size) == (theirs.d_model, theirs.n_heads, theirs.n_layers, theirs.max_seq_len, theirs.vocab_size)
    assert (ours.num_key_value_heads, ours.clip_qkv) == (attn.kv_n_heads, attn.clip_qkv)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.expert_weights_norm) == (
        ffn.moe_num_experts, ffn.moe_top_k, ffn.ffn_hidden_size, ffn.moe_normalize_expert_weights)
    assert (ours.bos_token_id, ours.eos_token_id, ours.tie_word_embeddings) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.tie_word_embeddings)
    # the base transformers 5.25 rotates by unless attn_config names one (module docstring of flashllm.models.dbrx)
    expected = changes.get("attn_config", {}).get("rope_theta", theirs.rope_parameters["rope_theta"])
    assert ours.rope_theta == expected and ours.rope_scaling is None and ours.rms_norm_eps == 1e-5


def test_fields_left_out_take_dbrxconfig_defaults() -> None:
    from transformers import DbrxConfig

    ours, theirs = parse_hf_config({"architectures": ["DbrxForCausalLM"], "model_type": "dbrx"}), DbrxConfig()
    attn, ffn = theirs.attn_config, theirs.ffn_config
    assert (ours.hidden_size, ours.num_attention_heads, ours.num_hidden_layers, ours.max_position_embeddings,
            ours.vocab_size, ours.num_key_value_heads, ours.clip_qkv) == (
        theirs.d_model, theirs.n_heads, theirs.n_layers, theirs.max_seq_len, theirs.vocab_size, attn.kv_n_heads,
        attn.clip_qkv)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.expert_weights_norm) == (
        ffn.moe_num_experts, ffn.moe_top_k, ffn.ffn_hidden_size, ffn.moe_normalize_expert_weights)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] and ours.eos_token_id is None


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"tie_word_embeddings": True}, "tie_word_embeddings=true is not supported"),
    ({"ffn_config": {"ffn_act_fn": {"name": "gelu"}}}, "ffn_act_fn name 'gelu' is not supported"),
    ({"ffn_config": {"moe_top_k": 5}}, "moe_top_k=5 exceeds moe_num_experts=4"),
    ({"ffn_config": {"moe_normalize_expert_weights": -1.0}}, "moe_normalize_expert_weights"),
    ({"attn_config": {"clip_qkv": 0}}, "clip_qkv"),
    ({"attn_config": {"kv_n_heads": 3}}, "num_key_value_heads"),
    ({"attn_config": "grouped"}, "attn_config must be an object or null"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported for DBRX"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}, "loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


def test_an_expert_tensor_of_another_size_is_refused_naming_it(dbrx, ops, model_registry, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = build_moe_model(tmp_path, "dbrx", seed=6)
    tensors = load_file(model_dir / "model.safetensors")
    name = "transformer.blocks.1.ffn.experts.mlp.v1"
    tensors[name] = tensors[name][:-8].contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"experts\.mlp\.v1 has shape \(184, 64\) but the model expects \(192, 64\)"):
        load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
