"""DeepSeek-V2/V3 decode through the cpu backend's fused native step (csrc/mla_decode.c's latent attention
block, csrc/moe_decode.c's DeepSeek routing, which ERNIE 4.5's softmax-with-a-choice-bias shares): the native MoE block against the model's own routing and the
reference fused_moe op, whole decodes against the per-op path (tokens, logprobs) and against transformers'
greedy tokens, multi-step bursts, and the models the step must leave to their own forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashllm.backends.cpu import decode_stack, moe_stack, native
from flashllm.llm import LLM
from flashllm.models.deepseek_config import DeepseekModelConfig
from flashllm.models.deepseek_moe import select_experts_grouped
from flashllm.ops.fused_moe import fused_moe as reference_fused_moe
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.registry.fusions import LinearWeights, MoEWeights
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import PRESETS, build_deepseek_model
from flashllm.testing.fused_decode import record_fused_steps

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

HIDDEN, INTER, SHARED = 64, 32, 64
PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63)), [9]]
MAX_TOKENS = [20, 9, 24, 13, 5]  # sequences leave the decode batch at different steps, down to one


class _CpuOps:
    """The part of an OpTable moe_stack.describe reads: fused_moe resolved to the cpu backend's kernel."""

    sources = {"fused_moe": "cpu"}

    @staticmethod
    def kernel(name: str):
        from flashllm.backends.cpu import moe

        return type("Kernel", (), {"fn": staticmethod(moe.fused_moe)})


class _Routing:
    """The fields of DeepseekModelConfig select_experts_grouped reads."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("sigmoid,groups,kept,top_k,renormalize,scaling", [
    (False, 1, 1, 6, False, 1.0),   # V2-Lite: softmax, plain top-6
    (False, 4, 2, 2, False, 1.5),   # V2: group-limited softmax, scaled
    (True, 4, 2, 2, True, 2.5),     # V3: sigmoid + bias within groups, renormalized, scaled
    (True, 2, 1, 3, False, 1.0),    # sigmoid, one group of two kept, not renormalized
    (False, 1, 1, 3, True, 1.0),    # ERNIE 4.5: softmax probabilities + a choice bias, renormalized
])
def test_the_native_block_routes_as_deepseek(tokens, sigmoid, groups, kept, top_k, renormalize, scaling) -> None:
    """The block's routing and experts against select_experts_grouped (the per-op path's torch routing,
    itself held to transformers in test_deepseek.py), the reference fused_moe op and an unscaled shared expert."""
    experts = 16
    gen = torch.Generator().manual_seed(experts * 10 + top_k + 100 * groups)
    router = torch.randn(experts, HIDDEN, generator=gen) * 0.5
    # V3's bias beside sigmoid scores; ERNIE's (renormalized softmax) of the size of its probabilities' spread
    bias = torch.randn(experts, generator=gen) * (0.3 if sigmoid else 0.05) if sigmoid or renormalize else None
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.1
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.1
    gate_up, down = torch.randn(2 * SHARED, HIDDEN, generator=gen) * 0.1, torch.randn(HIDDEN, SHARED, generator=gen) * 0.1
    dense = [LinearWeights(QuantizedWeight("none", w), None, 1) for w in (router, gate_up, down)]
    block = MoEWeights(dense[0], top_k, renormalize, w13, w2, None, None, 1, dense[1], dense[2], None,
                       scoring="sigmoid" if sigmoid else "softmax", correction_bias=bias, n_group=groups,
                       topk_group=kept, routed_scaling_factor=scaling)
    keep: list[torch.Tensor] = []
    desc = moe_stack.describe(block, HIDDEN, _CpuOps(), keep, decode_stack._linear)
    scratch = moe_stack.attach_scratch([desc])
    x = torch.randn(tokens, HIDDEN, generator=gen)
    got = moe_stack.run_block(desc, x)
    del scratch

    config = _Routing(num_experts_per_tok=top_k, sigmoid_scoring=sigmoid, group_limited=groups > 1, n_group=groups,
                      topk_group=kept, norm_topk_prob=renormalize, routed_scaling_factor=scaling)
    weights, ids = select_experts_grouped(x @ router.T, config, bias)  # type: ignore[arg-type]
    g, u = (x @ gate_up.T).chunk(2, dim=-1)
    expected = reference_fused_moe(x, w13, w2, weights, ids) + (F.silu(g) * u) @ down.T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_describe_refuses_routing_the_block_does_not_run() -> None:
    gen = torch.Generator().manual_seed(0)
    router = LinearWeights(QuantizedWeight("none", torch.randn(8, HIDDEN, generator=gen)), None, 1)
    w13, w2 = torch.randn(8, 2 * INTER, HIDDEN, generator=gen), torch.randn(8, HIDDEN, INTER, generator=gen)

    def refused(**changes) -> bool:
        fields = dict(router=router, top_k=2, renormalize=True, w13=w13, w2=w2, w13_scale=None, w2_scale=None,
                      experts_tp_size=1, shared_gate_up=None, shared_down=None, shared_gate=None)
        try:
            moe_stack.describe(MoEWeights(**{**fields, **changes}), HIDDEN, _CpuOps(), [], decode_stack._linear)
        except moe_stack.Unsupported:
            return True
        return False

    assert not refused(scoring="sigmoid", correction_bias=torch.zeros(8), n_group=4, topk_group=2)
    assert refused(scoring="tanh")
    assert refused(n_group=3)                                    # 8 experts are not 3 equal groups
    assert refused(n_group=4, topk_group=5)                      # more groups kept than there are
    assert refused(n_group=8, topk_group=1)                      # top-2 from one group of one expert
    assert refused(scoring="sigmoid", correction_bias=torch.zeros(7))
    assert refused(correction_bias=torch.zeros(8, dtype=torch.float64))
    assert not refused(correction_bias=torch.zeros(8))           # beside softmax probabilities (ERNIE 4.5)


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {p: build_deepseek_model(tmp_path_factory.mktemp(p), p, seed=5) for p in PRESETS}


def _engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **kwargs) -> LLM:
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if fused else "0")
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
               **{"num_scheduler_steps": 1, **kwargs})


def _generate(model_dir: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **kwargs) -> tuple[list, list, int]:
    """(tokens, logprobs per step, decode steps the fused path took) of one engine run."""
    taken = record_fused_steps(monkeypatch)
    llm = _engine(model_dir, monkeypatch, fused, **kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], sum(taken)


@pytest.mark.parametrize("preset,quant", [
    ("v2", {}), ("v2_lite", {}), ("v3", {}), ("v3_neox", {}),
    ("v2_lite", {"quant_type": "w8a16"}), ("v2_lite", {"moe_quant_type": "weight_only_int8"}),
])
def test_decode_through_the_fused_step_matches_the_per_op_path(ds_dirs, monkeypatch, preset, quant) -> None:
    """Greedy tokens identical and logprobs within fp32 rounding: the same kernels in the same order, only
    the routing's softmax / sigmoid and the weighted sums rounded by C instead of torch. Five sequences
    decode together (experts gathered across tokens) and leave the batch one by one."""
    fused_tokens, fused_logprobs, taken = _generate(ds_dirs[preset], monkeypatch, True, **quant)
    tokens, logprobs, untaken = _generate(ds_dirs[preset], monkeypatch, False, **quant)
    assert untaken == 0
    assert taken >= max(MAX_TOKENS) - 1  # every decode step went through the fused call
    assert fused_tokens == tokens
    for ours, theirs in zip(fused_logprobs, logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=2e-5)


@pytest.mark.parametrize("preset", ["v2", "v3"])
def test_fused_greedy_bursts_give_transformers_tokens(ds_dirs, monkeypatch, preset) -> None:
    """Multi-step greedy bursts (the fused step and the greedy head in one native call) against
    transformers' own greedy generate of the same checkpoint: an oracle independent of flashllm."""
    from transformers import AutoModelForCausalLM

    prompt, steps = PROMPTS[0], 24
    hf = AutoModelForCausalLM.from_pretrained(ds_dirs[preset], dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                               min_new_tokens=steps)[0, len(prompt):].tolist()
    llm = _engine(ds_dirs[preset], monkeypatch, True, num_scheduler_steps=8)
    assert llm.engine.runner._burst() is not None  # the burst applies: its steps are the fused ones
    out = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_models_the_step_does_not_run_keep_their_forward(ds_dirs, monkeypatch) -> None:
    llm = _engine(ds_dirs["v2"], monkeypatch, True)
    model = llm.engine.runner.model
    assert decode_stack.build(model) is not None
    model.set_matrix_absorption(False)  # the naive form: the block runs the absorbed one only
    assert decode_stack.build(model) is None
    model.set_matrix_absorption(True)
    model.model.layers[1].mlp.experts.expert_parallel = True  # experts split over ranks
    assert decode_stack.build(model) is None
    reference = LLM(str(ds_dirs["v2"]), backend="reference", dtype="float32", block_size=16, num_kv_blocks=8,
                    max_model_len=64)
    assert decode_stack.build(reference.engine.runner.model) is None


def test_the_routing_oracle_config_fields_exist() -> None:
    """_Routing stands in for DeepseekModelConfig: the fields it sets are the config's."""
    fields = set(DeepseekModelConfig.__dataclass_fields__)
    assert {"num_experts_per_tok", "sigmoid_scoring", "group_limited", "n_group", "topk_group", "norm_topk_prob",
            "routed_scaling_factor"} <= fields
