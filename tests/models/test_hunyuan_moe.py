"""Hunyuan MoE (HunYuanMoEV1ForCausalLM, Hunyuan-A13B): config.json read as transformers' HunYuanMoEV1Config reads it
(per-layer lists included), the checkpoint's router / shared-MLP names, the variants (one expert per token, no
attention biases, tied head) against transformers, and two tensor-parallel and two expert-parallel ranks. The tiny
preset's paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.hunyuan import HunyuanAttention
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["HunYuanMoEV1ForCausalLM"], "model_type": "hunyuan_v1_moe", "hidden_size": 64,
       "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
# Hunyuan-A13B-Instruct's MoE fields, as its config.json lists them per layer
A13B_LISTS = {"num_experts": 8, "moe_topk": [2, 2], "moe_intermediate_size": [48, 48], "num_shared_expert": [1, 1],
              "use_cla": False, "use_mixed_mlp_moe": True, "use_qk_norm": True}


@pytest.mark.parametrize("changes", [
    {}, A13B_LISTS,
    {"num_experts": 16, "moe_topk": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True,
     "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 32768},
    {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}, "num_experts": 4},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import HunYuanMoEV1Config
    from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Gate

    ours, theirs = parse_hf_config({**RAW, **changes}), HunYuanMoEV1Config(**{**RAW, **changes})
    gate = HunYuanMoEV1Gate(theirs, layer_idx=1)
    assert (ours.num_experts, ours.num_experts_per_tok) == (gate.num_experts, gate.top_k)
    assert ours.moe_intermediate_size == ours.shared_expert_intermediate_size == theirs.intermediate_size
    for field in ("num_key_value_heads", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "bos_token_id",
                  "eos_token_id", "max_position_embeddings", "hidden_act", "vocab_size"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.head_dim == (theirs.head_dim or theirs.hidden_size // theirs.num_attention_heads)
    assert ours.norm_topk_prob and not ours.sigmoid_scoring and not ours.group_limited and not ours.choice_bias
    assert all(ours.sparse_layers) and ours.qkv_bias == theirs.attention_bias


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"use_cla": True}, "use_cla=true"),
    ({"num_shared_expert": [2, 2]}, r"num_shared_expert=\[2, 2\]"),
    ({"moe_intermediate_size": 96}, "moe_intermediate_size=96 differs from intermediate_size=48"),
    ({"moe_topk": [2, 1], "num_experts": 4}, r"moe_topk=\[2, 1\]; flashllm runs one value"),
    ({"num_experts": 2, "moe_topk": 4}, "moe_topk=4 exceeds num_experts=2"),
    ({"num_experts": 0}, "num_experts=0 must be a positive int"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 16}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config({**RAW, **changes})
    assert "\n" not in str(info.value)


def test_the_checkpoint_names_its_router_wg_and_its_shared_mlp(tmp_path) -> None:
    from safetensors import safe_open

    model_dir = build_tiny_model(tmp_path, "hunyuan_moe", seed=1, tokenizer=False)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.mlp.gate.wg.weight", "model.layers.0.mlp.shared_mlp.gate_proj.weight",
            "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.1.self_attn.query_layernorm.weight",
            "model.layers.1.self_attn.o_proj.bias"} <= names


@pytest.mark.parametrize("changes", [{}, {"moe_topk": 1, "attention_bias": False, "tie_word_embeddings": True},
                                     {"num_experts": 6, "moe_topk": 3, "num_key_value_heads": 4}])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset (top-2 of 4, biased attention), one expert per token with a tied head and no biases, and top-3 of 6
    without GQA, against transformers' greedy tokens and logits."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "hunyuan_moe", seed=5, tokenizer=False, **changes)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    layer = model.model.layers[1]
    assert type(layer.self_attn) is HunyuanAttention and type(layer.mlp) is DeepseekMoE
    assert layer.mlp.top_k == changes.get("moe_topk", 2) and layer.mlp.shared_experts is not None
    assert (layer.self_attn.o_proj.bias is not None) == changes.get("attention_bias", True)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(changes.get("tie_word_embeddings"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8, 1e-4)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(options, tmp_path) -> None:
    """Tensor parallel ranks take their heads' and experts' feature slices; expert parallel ranks hold 2 experts."""
    model_dir = build_tiny_model(tmp_path, "hunyuan_moe", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir, **options)
