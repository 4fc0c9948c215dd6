"""GPT-J (the parallel block of one LayerNorm, bias-free attention, RoPE over adjacent pairs of the first rotary_dim
features, a biased LM head): config.json read as transformers' GPTJConfig reads it (GPT-2 names and their aliases),
refusals, variants against transformers (a tied head over full-head RoPE, a narrow MLP with exact GELU, GPT-J-6B's
causal-mask buffers in the checkpoint) and tensor parallelism. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets. CodeGen, GPT-J with one
qkv_proj laid out for 4 model-parallel shards, is checked the same way, and its fused tensor's row order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.gptj import split_codegen_qkv
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.phi import BiasedLMHead
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 4,
       "n_positions": 512, "rotary_dim": 4, "vocab_size": 256}
CODEGEN = {"architectures": ["CodeGenForCausalLM"], "model_type": "codegen", "n_ctx": 512}


def _config_classes():
    from transformers import CodeGenConfig, GPTJConfig

    return [({}, GPTJConfig), (CODEGEN, CodeGenConfig)]


@pytest.mark.parametrize("changes", [
    {},
    {"n_inner": 96, "rotary_dim": 16, "layer_norm_epsilon": 1e-3, "activation_function": "gelu"},
    # transformers' aliases win over GPT-J's own names where both are given
    {"hidden_size": 128, "num_attention_heads": 8, "num_hidden_layers": 3, "max_position_embeddings": 1024},
    # fields GPT-J's modeling never reads: its RoPE base is fixed, its MLP is n_inner wide, it has no GQA
    {"tie_word_embeddings": True, "rope_theta": 500.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
     "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 999, "rms_norm_eps": 0.5, "n_inner": None},
])
@pytest.mark.parametrize("family", [0, 1], ids=["gptj", "codegen"])
def test_config_reads_as_transformers_reads_it(changes, family) -> None:
    family_fields, config_class = _config_classes()[family]
    raw = {**RAW, **family_fields, **changes}
    ours, theirs = parse_hf_config(raw), config_class(**raw)
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads, ours.max_position_embeddings) == (
        theirs.n_embd, theirs.n_layer, theirs.n_head, theirs.n_positions)
    assert ours.intermediate_size == (theirs.n_inner if theirs.n_inner is not None else 4 * theirs.n_embd)
    assert ours.head_dim == theirs.n_embd // theirs.n_head and ours.num_key_value_heads == theirs.n_head
    assert (ours.rotary_dim, ours.rms_norm_eps, ours.hidden_act) == (
        theirs.rotary_dim, theirs.layer_norm_epsilon, theirs.activation_function)
    assert (ours.tie_word_embeddings, ours.bos_token_id, ours.eos_token_id) == (
        theirs.tie_word_embeddings, theirs.bos_token_id, theirs.eos_token_id)
    assert ours.rope_interleaved and (ours.rope_theta, ours.rope_scaling) == (10000.0, None)
    assert not ours.attention_bias and ours.mlp_bias


@pytest.mark.parametrize("family", [0, 1], ids=["gptj", "codegen"])
def test_fields_left_out_take_transformers_defaults(family) -> None:
    family_fields, config_class = _config_classes()[family]
    raw = {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", **family_fields}
    ours, theirs = parse_hf_config(raw), config_class()
    assert (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads) == (
        theirs.vocab_size, theirs.n_embd, theirs.n_layer, theirs.n_head) == (50400, 4096, 28, 16)
    assert (ours.max_position_embeddings, ours.rotary_dim, ours.rms_norm_eps, ours.hidden_act) == (
        theirs.n_positions, theirs.rotary_dim, theirs.layer_norm_epsilon, theirs.activation_function)
    assert ours.intermediate_size == 4 * theirs.n_embd and theirs.n_inner is None
    assert (ours.bos_token_id, ours.eos_token_id, ours.tie_word_embeddings) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.tie_word_embeddings)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"rotary_dim": None}, "rotary_dim=null"),
    ({"rotary_dim": 0}, "rotary_dim=0; expected a positive even int"),
    ({"rotary_dim": 5}, "positive even int"),
    ({"rotary_dim": 18}, "rotary_dim=18 is larger than the head_dim of n_embd / n_head = 16"),
    ({"rotary_dim": "4"}, "rotary_dim='4'"),
    ({"activation_function": "silu"}, "hidden_act='silu' is not supported"),
    ({"n_head": 5}, "not divisible by num_attention_heads=5"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "GPT-J loads float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})
    with pytest.raises(ModelLoadError, match=fragment.replace("GPT-J", "CodeGen")):
        parse_hf_config({**RAW, **CODEGEN, **changes})


def test_codegen_refuses_what_its_four_shards_cannot_split() -> None:
    parse_hf_config({**RAW, "n_embd": 66, "n_head": 6})  # GPT-J runs 66 = 6 heads of 11
    with pytest.raises(ModelLoadError, match="n_embd=66 is not a multiple of 4"):
        parse_hf_config({**RAW, **CODEGEN, "n_embd": 66, "n_head": 6})


def test_codegen_fused_projection_is_cut_shard_by_shard() -> None:
    """Rows (4 shards, [q | v | k], hidden / 4): shard s's q rows sit at 3s x hidden / 4; v comes before k."""
    hidden = 8
    rows = torch.arange(3 * hidden, dtype=torch.float32)[:, None].expand(3 * hidden, hidden)
    parts = dict(split_codegen_qkv([("transformer.h.0.attn.qkv_proj.weight", rows)], hidden))
    assert parts["transformer.h.0.attn.q_proj.weight"][:, 0].tolist() == [0, 1, 6, 7, 12, 13, 18, 19]
    assert parts["transformer.h.0.attn.v_proj.weight"][:, 0].tolist() == [2, 3, 8, 9, 14, 15, 20, 21]
    assert parts["transformer.h.0.attn.k_proj.weight"][:, 0].tolist() == [4, 5, 10, 11, 16, 17, 22, 23]
    with pytest.raises(ModelLoadError, match=r"has shape \(23, 8\)"):
        list(split_codegen_qkv([("transformer.h.0.attn.qkv_proj.weight", rows[:23])], hidden))


# the causal-mask buffers older checkpoints carry, which transformers ignores: GPT-J-6B's, CodeGen's
MASK_BUFFERS = {"gptj": {"attn.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool).tril(),
                         "attn.masked_bias": torch.tensor(-1e9)},
                "codegen": {"attn.causal_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()}}


def _add_mask_buffers(model_dir, preset: str) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for layer in range(2):
        tensors |= {f"transformer.h.{layer}.{name}": buffer.clone() for name, buffer in MASK_BUFFERS[preset].items()}
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(("preset", "changes"), [
    ("gptj", {"tie_word_embeddings": True, "rotary_dim": 16}),
    ("gptj", {"n_inner": 96, "activation_function": "gelu", "rotary_dim": 2}),
    ("gptj", {"hidden_size": 66, "num_attention_heads": 6, "rotary_dim": 4}),  # heads of 11 features, 4 rotated
    ("codegen", {"tie_word_embeddings": True, "rotary_dim": 8}),
    # two shards per head: head h's rows straddle shards
    ("codegen", {"num_attention_heads": 2, "rotary_dim": 32, "n_inner": 96}),
])
def test_variants_match_transformers(preset, changes, tmp_path) -> None:
    """The presets rotate part of each head with an untied head; a tied head (the bias stays its own) over full-head
    RoPE, a narrower MLP with exact GELU rotating one pair, heads of an odd width, and CodeGen heads wider than its
    shards, each with the checkpoint's mask buffers, against transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, preset, seed=5, tokenizer=False, **changes)
    _add_mask_buffers(model_dir, preset)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is None and attn.o_proj.bias is None
    assert not attn.rotary_emb.is_neox and attn.rotary_emb.rotary_dim == changes["rotary_dim"]
    assert isinstance(model.lm_head, BiasedLMHead)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(changes.get("tie_word_embeddings"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


@pytest.mark.parametrize("preset", ["gptj", "codegen"])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(preset, tmp_path) -> None:
    """Each rank takes its heads' q / k / v (for CodeGen, cut from the shards of qkv_proj) and out_proj slices, its
    share of fc_in / fc_out and of the head's vocabulary rows and bias."""
    model_dir = build_tiny_model(tmp_path / preset, preset, seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
