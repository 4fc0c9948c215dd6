"""GLM-4.5 / 4.6 (transformers' Glm4MoeForCausalLM) beyond the shared MoE checks of test_moe.py (paged forward, engine
greedy tokens and logits, transformers 5's stacked experts): its config (half-rotary default, q / k norms, DeepSeek-V3
routing fields), the cpu backend's fused decode step against the per-op path and transformers, two tensor-parallel
and two expert-parallel ranks, and the next-token-prediction layer published checkpoints append."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.backends.cpu import decode_stack, native
from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeModelConfig
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.mlp import GatedMLP
from flashllm.sampling_params import SamplingParams
from flashllm.testing.fused_decode import record_fused_steps
from flashllm.testing.loading import load_flashllm
from flashllm.testing.parity import hf_logits, random_tokens
from flashllm.testing.tiny_moe import MOE_BASE, MOE_PRESETS, build_moe_model

MODEL_TYPE, ARCHITECTURE, FIELDS = MOE_PRESETS["glm4_moe"]
PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63)), [9]]
MAX_TOKENS = [20, 9, 24, 13, 5]  # sequences leave the decode batch at different steps, down to one


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe_model(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe", seed=7)


def _raw(**changes) -> dict:
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **MOE_BASE, **FIELDS, **changes}


def _hf_greedy(model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(theirs, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_the_config_reads_glm_s_fields_and_defaults() -> None:
    config = parse_hf_config(_raw())
    assert isinstance(config, Glm4MoeModelConfig)
    assert (config.head_dim, config.rotary_dim, config.qk_norm, config.qkv_bias) == (24, 12, True, True)
    assert config.sparse_layers == (False, True, True)  # first_k_dense_replace 1
    assert (config.n_routed_experts, config.num_experts, config.num_experts_per_tok) == (8, 8, 3)
    assert (config.sigmoid_scoring, config.group_limited, config.n_group, config.topk_group) == (True, True, 2, 1)
    assert (config.routed_scaling_factor, config.n_shared_experts, config.shared_expert_intermediate_size) == (1.5, 1, 48)
    # published config.json files: partial_rotary_factor at the top level (or absent: transformers' default 0.5)
    bare = {k: v for k, v in _raw().items() if k not in ("head_dim", "use_qk_norm", "attention_bias")}
    config = parse_hf_config(bare)
    assert (config.head_dim, config.rotary_dim, config.qk_norm, config.qkv_bias) == (16, 8, False, False)
    assert parse_hf_config(_raw(partial_rotary_factor=0.25)).rotary_dim == 6
    # transformers 5 writes it inside rope_parameters, and prefers it there
    inner = _raw(partial_rotary_factor=0.25, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                              "partial_rotary_factor": 1.0})
    config = parse_hf_config(inner)
    assert (config.rotary_dim, config.rope_theta, config.rope_scaling) == (24, 5e5, None)
    defaults = parse_hf_config({k: v for k, v in _raw().items() if k not in (
        "n_routed_experts", "moe_intermediate_size", "n_group", "topk_group", "routed_scaling_factor",
        "first_k_dense_replace", "n_shared_experts", "num_experts_per_tok")})
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size) == (128, 8, 1408)
    assert (defaults.n_group, defaults.topk_group, defaults.routed_scaling_factor) == (1, 1, 1.0)
    assert defaults.sparse_layers == (False, True, True) and defaults.n_shared_experts == 1


@pytest.mark.parametrize("changes, fragment", [
    ({"n_group": 3}, "n_group=3, topk_group=1 do not fit n_routed_experts=8"),
    ({"num_experts_per_tok": 5}, "do not fit n_routed_experts=8 and num_experts_per_tok=5"),  # 4 in one group
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not what Glm4MoeForCausalLM routes by"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace=4 must be an int in 0..3"),
    ({"use_qk_norm": "yes"}, "use_qk_norm='yes' must be true or false"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"partial_rotary_factor": 0.125}, "partial_rotary_factor=0.125 with head_dim=24 gives rotary_dim=3"),
])
def test_bad_configs_are_refused_in_one_line_naming_the_field(changes, fragment) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config(_raw(**changes))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_the_layers_are_what_the_config_asks_for(glm_dir, ops) -> None:
    model = load_flashllm(glm_dir, ops)
    assert type(model) is Glm4MoeForCausalLM
    layers = model.model.layers
    assert type(layers[0].mlp) is GatedMLP and all(type(layer.mlp) is DeepseekMoE for layer in layers[1:])
    moe = layers[1].mlp
    assert moe.experts.w13_weight.shape == (8, 96, 64) and moe.shared_experts.down_proj.qweight.in_features == 48
    assert moe.gate.e_score_correction_bias.abs().sum() > 0  # the builder's random bias reached the router
    attn = layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is not None
    assert model.model.rotary_emb.rotary_dim == 12 and model.model.rotary_emb.is_neox


def _generate(model_dir: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **options) -> tuple[list, list, int]:
    """(tokens, logprobs per step, decode steps the fused path took) of one engine run."""
    taken = record_fused_steps(monkeypatch)
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if fused else "0")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
              num_scheduler_steps=1, **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], sum(taken)


@pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("options", [{}, {"quant_type": "w8a16"}])
def test_decode_through_the_fused_step_matches_the_per_op_path(glm_dir, tmp_path, monkeypatch, options) -> None:
    """The cpu backend's fused decode step (partial neox RoPE, q / k norms, DeepSeek routing in C) against the
    per-op path: greedy tokens identical, logprobs within fp32 rounding, every decode step fused. The int8
    kernels take whole groups of 32 input features: the w8a16 model's experts have 64."""
    model_dir = build_moe_model(tmp_path, "glm4_moe", seed=7, moe_intermediate_size=64) if options else glm_dir
    fused_tokens, fused_logprobs, taken = _generate(model_dir, monkeypatch, True, **options)
    tokens, logprobs, untaken = _generate(model_dir, monkeypatch, False, **options)
    assert untaken == 0 and taken >= max(MAX_TOKENS) - 1
    assert fused_tokens == tokens
    for ours, theirs in zip(fused_logprobs, logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=2e-5)


@pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
def test_fused_greedy_bursts_give_transformers_tokens(glm_dir, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    prompt, steps = PROMPTS[0], 24
    hf = AutoModelForCausalLM.from_pretrained(glm_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                               min_new_tokens=steps)[0, len(prompt):].tolist()
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    llm = LLM(str(glm_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
              num_scheduler_steps=8)
    assert llm.engine.runner._burst() is not None
    out = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def _run(model_dir: Path, prompts: list[list[int]], **options) -> tuple[list[tuple[list[int], list]], object]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=16, **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        model = llm.engine.parts.model
    finally:
        llm.engine.shutdown()
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs], model


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_give_one_rank_s_tokens_and_transformers_greedy(glm_dir, expert_parallel) -> None:
    """Tensor parallel: every expert's intermediate features split over the ranks; expert parallel: experts 0..3
    whole on the driver. Attention (its q / k norms per head), the shared expert and the dense layer stay split."""
    prompts = [random_tokens(n, 256, seed=80 + n) for n in (5, 23, 40)]
    one, _ = _run(glm_dir, prompts)
    two, model = _run(glm_dir, prompts, tensor_parallel_size=2, distributed_executor_backend="mp",
                      enable_expert_parallel=expert_parallel)
    experts = model.model.layers[1].mlp.experts
    assert (experts.expert_parallel, experts.num_local_experts) == ((True, 4) if expert_parallel else (False, 8))
    assert model.model.layers[1].mlp.shared_experts.down_proj.qweight.in_features == 24
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4
    assert one[1][0] == _hf_greedy(glm_dir, prompts[1], 10)


def test_the_appended_next_token_prediction_layer_is_skipped(glm_dir, tmp_path, ops) -> None:
    """Published GLM-4.5 checkpoints carry model.layers.{num_hidden_layers}.* (the MTP layer transformers ignores):
    the model loads without it, to the same weights."""
    copy = Path(shutil.copytree(glm_dir, tmp_path / "with_mtp"))
    tensors = load_file(copy / "model.safetensors")
    extra = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
             for name, t in tensors.items() if name.startswith("model.layers.2.")}
    extra.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
                  "model.layers.3.hnorm.weight": torch.ones(64),
                  "model.layers.3.shared_head.norm.weight": torch.ones(64)})
    save_file({**tensors, **extra}, copy / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((copy / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ours, plain = load_flashllm(copy, ops), load_flashllm(glm_dir, ops)
    for (name, a), (_, b) in zip(ours.state_dict().items(), plain.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
