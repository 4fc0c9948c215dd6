"""ERNIE 4.5 beyond the dense preset's parity checks (tests/models/test_parity_forward.py, test_engine_parity.py): its
config defaults, the dense model's decode through the cpu backend's fused step, and the MoE model (softmax scores
chosen with a choice bias, a shared expert, interval-placed MoE layers) against transformers' own class on a
tiny random checkpoint: varlen prefill and decode over the paged cache, chunked prefill beside a decode, the engine's
greedy tokens and logits, two tensor-parallel and two expert-parallel ranks, the checkpoints' MTP tensors skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.backends.cpu import decode_stack, native
from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.ernie4_5 import Ernie4_5_MoeForCausalLM, Ernie4_5MoeModelConfig
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK
from flashllm.sampling_params import SamplingParams
from flashllm.testing.fused_decode import record_fused_steps
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import (
    check_engine_greedy_against,
    random_tokens,
)
from flashllm.testing.tiny_models import build_tiny_model
from flashllm.testing.tiny_moe import ERNIE_MOE_PRESET, MOE_BASE, build_moe_model, check_paged_parity, moe_reference

MODEL_TYPE, ARCHITECTURE, FIELDS = ERNIE_MOE_PRESET
VOCAB = MOE_BASE["vocab_size"]
PROMPT_LENGTHS = (1, 7, 63, 65, 130)
ATOL = 1e-4


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(transformers Ernie4_5_MoeForCausalLM, its directory)."""
    return moe_reference(tmp_path_factory.mktemp("ernie_moe"), "ernie4_5_moe", seed=9)


def _raw(**changes) -> dict:
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **MOE_BASE, **FIELDS, **changes}


def test_configs_follow_transformers_defaults() -> None:
    dense = parse_hf_config({"architectures": ["Ernie4_5ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "vocab_size": 256})
    assert (dense.head_dim, dense.rope_theta, dense.tie_word_embeddings, dense.rms_norm_eps) == (128, 500000.0, True, 1e-5)
    assert dense.rope_interleaved and not dense.attention_bias and not dense.mlp_bias
    config = parse_hf_config(_raw())
    assert isinstance(config, Ernie4_5MoeModelConfig)
    assert config.sparse_layers == (False, True, False, True)  # interval 2 from layer 1
    assert (config.num_experts, config.num_experts_per_tok, config.n_shared_experts) == (8, 3, 1)
    assert (config.sigmoid_scoring, config.choice_bias, config.norm_topk_prob, config.group_limited) == (
        False, True, True, False)
    assert config.rope_interleaved and not config.qkv_bias
    bare = {k: v for k, v in _raw().items() if not k.startswith("moe_")}
    defaults = parse_hf_config({**bare, "num_hidden_layers": 3, "intermediate_size": 128})
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size) == (64, 6, 1536)
    assert defaults.n_shared_experts == 2 and defaults.sparse_layers == (False, True, True)
    assert parse_hf_config(_raw(moe_layer_end_index=2)).sparse_layers == (False, True, False, False)


@pytest.mark.parametrize("changes, fragment", [
    ({"moe_k": 9}, "moe_k=9 exceeds moe_num_experts=8"),
    ({"moe_layer_start_index": 4}, "moe_layer_start_index=4 must be a layer index in 0..3"),
    ({"moe_layer_interval": 0}, "moe_layer_interval=0 must be a positive int"),
    ({"moe_num_shared_experts": -1}, "moe_num_shared_experts=-1 must be a non-negative int"),
    ({"use_bias": "yes"}, "use_bias='yes' must be true or false"),
    ({"use_bias": True}, "use_bias=true is not supported for Ernie4_5_MoeForCausalLM"),
])
def test_bad_moe_configs_are_refused_in_one_line(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config(_raw(**changes))
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
def test_dense_decode_runs_through_the_fused_step_as_transformers_generates(tmp_path, monkeypatch) -> None:
    """The cpu backend's fused decode step turns adjacent pairs (the rotary table's is_neox=False) and adds every
    projection's bias: transformers' greedy tokens, every decode step fused."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "ernie4_5", seed=4, tokenizer=False)
    prompt, steps = [5, 17, 3, 99, 42, 7, 1], 20
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                               min_new_tokens=steps)[0, len(prompt):].tolist()
    taken = record_fused_steps(monkeypatch)
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
              num_scheduler_steps=1)
    assert not llm.engine.runner.model.model.rotary_emb.is_neox
    out = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected
    assert sum(taken) >= steps - 1


def test_the_moe_layers_are_what_the_config_asks_for(moe, ops, model_registry) -> None:
    _, model_dir = moe
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert type(ours) is Ernie4_5_MoeForCausalLM
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    assert kinds == [GatedMLP, DeepseekMoE, GatedMLP, DeepseekMoE]
    block = ours.model.layers[1].mlp
    assert block.gate.e_score_correction_bias.shape == (8,) and block.gate.e_score_correction_bias.abs().sum() > 0
    assert ours.model.rotary_emb.is_neox is False
    moes = [layer.moe for layer in ours.fusions()[DECODER_STACK].layers]
    assert [moe is not None for moe in moes] == [False, True, False, True]
    assert (moes[1].scoring, moes[1].renormalize) == ("softmax", True)
    assert moes[1].correction_bias.data_ptr() == block.gate.e_score_correction_bias.data_ptr()


def test_moe_varlen_prefill_and_decode_match_transformers(moe, ops, model_registry, paged_driver) -> None:
    check_paged_parity(moe, ops, model_registry, paged_driver, VOCAB, PROMPT_LENGTHS, ATOL)


def test_moe_chunked_prefill_beside_a_decode_matches_transformers(moe, ops, model_registry, paged_driver) -> None:
    check_paged_parity(moe, ops, model_registry, paged_driver, VOCAB, None, ATOL)


def _llm(model_dir: Path, **kw) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "device": "cpu", "block_size": 16, "max_model_len": 256,
                                  "num_kv_blocks": 64, **kw})


def test_moe_engine_greedy_tokens_and_logits_match_transformers(moe) -> None:
    hf_model, model_dir = moe
    check_engine_greedy_against(_llm(model_dir), hf_model, [random_tokens(n, VOCAB, seed=n) for n in PROMPT_LENGTHS], 16,
                                ATOL)


@pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("options", [{}, {"quant_type": "w8a16"}])
def test_moe_decode_through_the_fused_step_matches_the_per_op_path(moe, tmp_path, monkeypatch, options) -> None:
    """The native MoE block (softmax probabilities + the choice bias choose, renormalized probabilities weigh) against
    the per-op path's torch routing: greedy tokens identical, logprobs within fp32 rounding, every decode fused. The
    int8 kernels take whole groups of 32 input features: the w8a16 model's experts have 64."""
    model_dir = build_moe_model(tmp_path, "ernie4_5_moe", seed=9, moe_intermediate_size=64) if options else moe[1]
    prompts = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, list(range(30, 63)), [9]]
    runs = []
    for fused in (True, False):
        taken = record_fused_steps(monkeypatch)
        monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if fused else "0")
        llm = _llm(model_dir, num_scheduler_steps=1, **options)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in (20, 9, 13, 5)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], sum(taken)))
    (fused_tokens, fused_logprobs, taken), (tokens, logprobs, untaken) = runs
    assert untaken == 0 and taken >= 19 and fused_tokens == tokens
    for ours, theirs in zip(fused_logprobs, logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=2e-5)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(moe, options) -> None:
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=50 + n) for n in (5, 40)], moe[1], **options)


def test_the_checkpoints_mtp_tensors_are_skipped(moe, tmp_path, ops, model_registry) -> None:
    """Published ERNIE 4.5 MoE checkpoints carry model.mtp_* tensors (transformers ignores them), and some the choice
    bias as mlp.gate.moe_statics.*: the same model loads."""
    _, model_dir = moe
    copy = tmp_path / "with_mtp"
    copy.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (copy / item.name).write_bytes(item.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    bias = tensors.pop("model.layers.1.mlp.moe_statics.e_score_correction_bias")
    tensors["model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"] = bias
    tensors.update({"model.mtp_linear_proj.0.weight": torch.zeros(64, 128), "model.mtp_emb_norm.0.weight": torch.ones(64),
                    "model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(64, 64)})
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    ours, _ = load_model(copy, ops, torch.float32, "cpu", model_registry, progress=False)
    plain, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    for (name, a), (_, b) in zip(ours.state_dict().items(), plain.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
