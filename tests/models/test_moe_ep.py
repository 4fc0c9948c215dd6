"""Expert parallelism for Mixtral, Qwen2-MoE and Qwen3-MoE (--enable-expert-parallel): each rank holds E / ranks
whole experts while attention, the dense MLPs and the shared expert stay tensor parallel. Two gloo ranks against
one rank through the engine and against transformers' greedy tokens; the layer-level sums are checked for every
architecture in tests/models/test_deepseek_ep.py (FusedMoE is shared)."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.sampling_params import SamplingParams
from flashllm.testing.parity import hf_logits, random_tokens
from flashllm.testing.tiny_moe import MOE_PRESETS, build_moe_model

BLOCK = 16
# preset -> whether the checkpoint keeps transformers 5's stacked expert tensors (the others: one tensor per expert
# and projection, as published Mixtral / Qwen MoE checkpoints are)
CASES = {"mixtral": False, "qwen2_moe": False, "qwen3_moe": True}


def _experts(preset: str) -> int:
    fields = MOE_PRESETS[preset][2]
    return fields.get("num_local_experts", fields.get("num_experts"))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {preset: build_moe_model(tmp_path_factory.mktemp(preset), preset, seed=11, original_format=not stacked)
            for preset, stacked in {**CASES, "qwen2_moe_top8": False}.items()}


def _run(model_dir, tp: int, prompts: list[list[int]], **options) -> tuple[list[tuple[list[int], list]], object]:
    """Greedy tokens and their logprobs on `tp` ranks (16-token prefill chunks), and the driver's model."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None, block_size=BLOCK, num_kv_blocks=64,
              max_num_batched_tokens=16, **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        model = llm.engine.parts.model
    finally:
        llm.engine.shutdown()  # a later tensor-parallel test in this process must be able to join a group
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs], model


def _hf_greedy(model_dir, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(theirs, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("preset", list(CASES))
def test_two_expert_parallel_ranks_give_one_rank_s_tokens_and_transformers_greedy(preset, moe_dirs) -> None:
    """The driver holds experts 0..E/2 - 1 whole (all their intermediate features), its shared expert and dense
    MLPs half of theirs; the two ranks' greedy tokens are one rank's and transformers', logprobs within 1e-4."""
    prompts = [random_tokens(n, 256, seed=60 + n) for n in (5, 23, 40)]
    one, _ = _run(moe_dirs[preset], 1, prompts)
    two, model = _run(moe_dirs[preset], 2, prompts, enable_expert_parallel=True)
    experts, fields = _experts(preset), MOE_PRESETS[preset][2]
    inter = fields.get("moe_intermediate_size", fields["intermediate_size"])
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        moe = block.experts
        assert (moe.expert_parallel, moe.num_local_experts, moe.first_expert) == (True, experts // 2, 0)
        assert tuple(moe.w13_weight.shape) == (experts // 2, 2 * inter, 64)
        assert tuple(moe.w2_weight.shape) == (experts // 2, 64, inter)
        if block.shared_expert is not None:  # still split over the ranks' features
            assert block.shared_expert.down_proj.qweight.in_features == fields["shared_expert_intermediate_size"] // 2
    for layer in model.model.layers:
        if isinstance(layer.mlp, GatedMLP):
            assert layer.mlp.down_proj.qweight.in_features == fields["intermediate_size"] // 2
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4
    assert one[1][0] == _hf_greedy(moe_dirs[preset], prompts[1], 10)


def test_integer_experts_under_expert_parallelism_give_one_rank_s_tokens(moe_dirs, monkeypatch,
                                                                         exact_w8_products) -> None:
    """Qwen2-MoE, top-8 of 12 experts (6 a rank, so most tokens need both ranks' experts), int4 groups of 16:
    each rank quantizes its whole experts as one rank does, so the tokens and logprobs are one rank's."""
    # the int4 dense layers' default int8 activations are blocks a row-parallel split cuts differently
    monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
    prompts = [random_tokens(n, 256, seed=70 + n) for n in (6, 37)]
    options = {"quant_type": "weight_only_int4", "group_size": 16}
    one, _ = _run(moe_dirs["qwen2_moe_top8"], 1, prompts, **options)
    two, model = _run(moe_dirs["qwen2_moe_top8"], 2, prompts, enable_expert_parallel=True, **options)
    moe = model.model.layers[0].mlp.experts
    assert (moe.num_local_experts, moe.w13_weight.dtype, tuple(moe.w13_scale.shape)) == (6, torch.uint8, (6, 128, 4))
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4
