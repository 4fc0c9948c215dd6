"""MPT (ALiBi, no biases, one fused Wqkv of whole q | k | v): config.json read as transformers' MptConfig reads it,
MPT's ALiBi slopes against transformers' for every head count, softmax_scale with clip_qkv, the untied head, a
power-of-two head count and MosaicML's `MPTForCausalLM` name against transformers, and tensor parallelism. The tiny
preset's paged-forward and engine parity with transformers run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config, uses_alibi
from flashllm.models.mpt import split_wqkv
from flashllm.ops.alibi_slopes import alibi_slopes
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["MptForCausalLM"], "model_type": "mpt", "d_model": 64, "n_layers": 2, "n_heads": 4,
       "vocab_size": 256}


@pytest.mark.parametrize("changes", [
    {},
    # mpt-7b's config.json: MosaicML's architecture name, a full attn_config, eos / bos ids
    {"architectures": ["MPTForCausalLM"], "max_seq_len": 65536, "expansion_ratio": 4, "layer_norm_epsilon": 1e-3,
     "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "triton", "attn_pdrop": 0, "clip_qkv": None,
                     "attn_type": "multihead_attention", "attn_uses_sequence_id": False, "prefix_lm": False,
                     "qk_ln": False, "softmax_scale": None}, "bos_token_id": 0, "eos_token_id": 0,
     "learned_pos_emb": True, "norm_type": "low_precision_layernorm", "init_device": "meta", "no_bias": True},
    # transformers' names win over d_model / n_heads / n_layers where a config.json has both; untied
    {"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 3, "tie_word_embeddings": False,
     "attn_config": {"softmax_scale": 0.5, "clip_qkv": 8.0}},
    {"attn_config": {"clip_qkv": 0.0}, "ffn_config": {"ffn_type": "mptmlp"}},  # 0 (falsy) clamps nothing
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import MptConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), MptConfig(**{**RAW, **changes})
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads, ours.vocab_size) == (
        theirs.d_model, theirs.n_layers, theirs.n_heads, theirs.vocab_size)
    assert ours.intermediate_size == 4 * theirs.d_model and ours.num_key_value_heads == theirs.n_heads
    assert ours.head_dim == theirs.d_model // theirs.n_heads
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (theirs.layer_norm_epsilon, theirs.max_seq_len)
    assert (ours.tie_word_embeddings, ours.bos_token_id, ours.eos_token_id) == (
        theirs.tie_word_embeddings, theirs.bos_token_id, theirs.eos_token_id)
    assert ours.softmax_scale == theirs.attn_config.softmax_scale
    assert ours.clip_qkv == (theirs.attn_config.clip_qkv or None)
    assert not ours.attention_bias and not ours.mlp_bias and ours.hidden_act == "gelu" and uses_alibi(ours)


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import MptConfig

    ours, theirs = parse_hf_config({"architectures": ["MptForCausalLM"], "model_type": "mpt"}), MptConfig()
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "bos_token_id",
                  "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (theirs.layer_norm_epsilon, theirs.max_seq_len)
    assert ours.intermediate_size == theirs.expansion_ratio * theirs.d_model
    assert (ours.softmax_scale, ours.clip_qkv) == (None, None)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"attn_config": {"alibi": False}}, "attn_config.alibi=false"),
    ({"attn_config": {"prefix_lm": True}}, "attn_config.prefix_lm=true"),
    ({"attn_config": {"qk_ln": True}}, "attn_config.qk_ln=true"),
    ({"attn_config": {"attn_type": "multiquery_attention"}}, "attn_type='multiquery_attention'"),
    ({"attn_config": {"alibi_bias_max": 16}}, "alibi_bias_max=16"),
    ({"attn_config": {"softmax_scale": -1.0}}, "softmax_scale=-1.0"),
    ({"attn_config": "torch"}, "attn_config must be an object"),
    ({"logit_scale": "inv_sqrt_d_model"}, "logit_scale='inv_sqrt_d_model'"),
    ({"no_bias": False}, "no_bias=false"),
    ({"ffn_config": {"ffn_type": "mptglu"}}, "ffn_config="),
    ({"expansion_ratio": 2.5}, "expansion_ratio=2.5"),
    ({"n_heads": 6}, "hidden_size=64 is not divisible by num_attention_heads=6"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 7, 8, 12, 16, 20, 32, 48, 56, 64, 71, 112])
def test_alibi_slopes_are_transformers_mpt_slopes(heads) -> None:
    """MPT's rule (2^ceil(log2 n) geometric slopes, odd ones first) is BLOOM's for every head count at bias max 8:
    mpt-7b's 32 heads, mpt-30b's 64 and more."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(heads, 2)  # (heads, 1, 2): slope x (key - last key) for keys 0 and 1
    torch.testing.assert_close(alibi_slopes(heads), -bias[:, 0, 0], rtol=1e-6, atol=0)


def test_wqkv_is_cut_into_whole_thirds() -> None:
    rows = torch.arange(3 * 64, dtype=torch.float32)[:, None].expand(-1, 64)
    parts = dict(split_wqkv([("transformer.blocks.0.attn.Wqkv.weight", rows)], 64))
    assert [parts[f"transformer.blocks.0.attn.{p}_proj.weight"][:, 0].tolist() for p in "qkv"] == [
        list(range(0, 64)), list(range(64, 128)), list(range(128, 192))]
    with pytest.raises(ModelLoadError, match="Wqkv"):
        list(split_wqkv([("transformer.blocks.0.attn.Wqkv.weight", torch.zeros(190, 64))], 64))


@pytest.mark.parametrize("variant", ["scaled_and_clipped", "untied", "power_of_two_heads", "mosaicml_name"])
def test_variants_match_transformers(variant, tmp_path) -> None:
    """The preset is mpt-7b's plain attention over 6 heads, tied; softmax_scale with a clip_qkv small enough to clamp
    many of the tiny model's q / k / v values, an untied head, 8 heads, and config.json's MPTForCausalLM."""
    from transformers import AutoModelForCausalLM

    changes = {"scaled_and_clipped": {"attn_config": {"softmax_scale": 0.5, "clip_qkv": 0.3}},
               "untied": {"tie_word_embeddings": False}, "power_of_two_heads": {"num_attention_heads": 8},
               "mosaicml_name": {}}[variant]
    model_dir = build_tiny_model(tmp_path, "mpt", seed=5, tokenizer=False, **changes)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if variant == "mosaicml_name":  # and tensors saved from the base model, without the `transformer.` prefix
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["MPTForCausalLM"]}))
        tensors = load_file(model_dir / "model.safetensors")
        save_file({name.removeprefix("transformer."): tensor for name, tensor in tensors.items()},
                  model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.bias is None and model.model.norm.bias is None
    assert attention.clip_qkv == changes.get("attn_config", {}).get("clip_qkv")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (variant != "untied")
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank takes its heads' rows of each third of every Wqkv, and its heads' slopes; clip_qkv on each shard."""
    model_dir = build_tiny_model(tmp_path / "mpt", "mpt", seed=2, tokenizer=False, attn_config={"clip_qkv": 0.5})
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
