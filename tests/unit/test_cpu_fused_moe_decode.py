"""The fused decode step's mixture-of-experts layers (moe_stack.py, csrc/moe_decode.c): the native block
against the reference fused_moe op and a routing written here, and MoE models' decode through the fused
step against their per-op path (tiny Mixtral and Qwen2-MoE checkpoints written by transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashllm.backends.cpu import decode_stack, moe_stack, native
from flashllm.llm import LLM
from flashllm.ops.fused_moe import fused_moe as reference_fused_moe
from flashllm.ops.quant_matmul import QuantizedWeight, dequantize, pack_int4
from flashllm.registry.fusions import LinearWeights, MoEWeights
from flashllm.sampling_params import SamplingParams
from flashllm.testing.fused_decode import record_fused_steps
from flashllm.testing.tiny_moe import build_moe_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

HIDDEN, INTER, SHARED = 64, 96, 128


class _CpuOps:
    """The part of an OpTable describe() reads: fused_moe resolved to the cpu backend's kernel."""

    sources = {"fused_moe": "cpu"}

    @staticmethod
    def kernel(name: str):
        from flashllm.backends.cpu import moe

        return type("Kernel", (), {"fn": staticmethod(moe.fused_moe)})


def _quantized(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) fp32 -> codes and scales as FusedMoE stores w8a16 (per row) and w4a16 (groups of 32) experts."""
    experts, rows, k = weight.shape
    if scheme == "w8a16":
        scales = weight.abs().amax(-1) / 127
        return torch.round(weight / scales[..., None]).to(torch.int8), scales
    grouped = weight.reshape(experts, rows, k // 32, 32)
    scales = grouped.abs().amax(-1) / 7
    codes = torch.round(grouped / scales[..., None]).clamp(-7, 7).reshape(experts, rows, k) + 8
    return pack_int4(codes.to(torch.uint8)), scales


def _linear(weight: torch.Tensor, scheme: str) -> tuple[LinearWeights, torch.Tensor]:
    """A one-rank linear layer of `weight` in `scheme` (fp32, or w8a16 per row) and the fp32 weight it stands for."""
    if scheme == "none":
        return LinearWeights(QuantizedWeight("none", weight), None, 1), weight
    codes, scales = _quantized(weight[None], "w8a16")
    q = QuantizedWeight("w8a16", codes[0], scales[0][:, None])
    return LinearWeights(q, None, 1), dequantize(q)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("experts,top_k,renormalize,shared,scheme", [
    (4, 1, True, False, "none"),      # Mixtral-like top-1
    (8, 2, True, False, "none"),      # Mixtral: top-2 renormalized
    (8, 2, False, True, "w8a16"),
    (60, 4, False, True, "none"),     # Qwen1.5-MoE's routing
    (12, 8, False, True, "w8a16"),
    (12, 8, True, False, "w4a16"),
    (16, 8, False, True, "none"),
])
def test_the_native_block_computes_the_reference_routing_and_fused_moe(tokens, experts, top_k, renormalize, shared,
                                                                        scheme) -> None:
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    router = torch.randn(experts, HIDDEN, generator=gen) * 0.3
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.1
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.1
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if scheme != "none":
        (w13, s13), (w2, s2) = _quantized(w13, scheme), _quantized(w2, scheme)
        scales = (s13, s2)
    parts = (None, None, None)
    if shared:
        shared_scheme = "w8a16" if scheme == "w8a16" else "none"
        parts = tuple(_linear(torch.randn(shape, generator=gen) * 0.1, shared_scheme)
                      for shape in ((2 * SHARED, HIDDEN), (HIDDEN, SHARED), (1, HIDDEN)))
    block = MoEWeights(LinearWeights(QuantizedWeight("none", router), None, 1), top_k, renormalize, w13, w2,
                       *scales, 1, *(None if p is None else p[0] for p in parts))
    keep: list[torch.Tensor] = []
    desc = moe_stack.describe(block, HIDDEN, _CpuOps(), keep, decode_stack._linear)
    scratch = moe_stack.attach_scratch([desc])
    x = torch.randn(tokens, HIDDEN, generator=gen)
    got = moe_stack.run_block(desc, x)
    del scratch

    # the oracle: softmax routing over every expert, the top k (renormalized or not), the reference op,
    # and the shared expert's gated MLP scaled by its sigmoid gate
    probs = torch.softmax(x @ router.T, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    expected = reference_fused_moe(x, w13, w2, weights, ids, *scales)
    if shared:
        (_, gate_up), (_, down), (_, gate) = parts
        g, u = (x @ gate_up.T).chunk(2, dim=-1)
        expected = expected + torch.sigmoid(x @ gate.T) * ((F.silu(g) * u) @ down.T)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_describe_refuses_what_the_block_does_not_run() -> None:
    gen = torch.Generator().manual_seed(0)
    router = LinearWeights(QuantizedWeight("none", torch.randn(4, HIDDEN, generator=gen)), None, 1)
    w13, w2 = torch.randn(4, 2 * INTER, HIDDEN, generator=gen), torch.randn(4, HIDDEN, INTER, generator=gen)

    def refused(**changes) -> bool:
        fields = dict(router=router, top_k=2, renormalize=True, w13=w13, w2=w2, w13_scale=None, w2_scale=None,
                      experts_tp_size=1, shared_gate_up=None, shared_down=None, shared_gate=None)
        try:
            moe_stack.describe(MoEWeights(**{**fields, **changes}), HIDDEN, _CpuOps(), [], decode_stack._linear)
        except (moe_stack.Unsupported, decode_stack._Unsupported):
            return True
        return False

    assert not refused()
    assert refused(experts_tp_size=2)                                   # experts split over ranks
    assert refused(w13=w13.half(), w2=w2.half())                        # fp16 experts
    assert refused(top_k=5)                                             # more experts a token than the layer has
    assert refused(w2=w2[:, :, :64])                                    # down does not match gate_up
    assert refused(w13=w13.transpose(1, 2).contiguous().transpose(1, 2))  # not contiguous
    codes, scales = _quantized(torch.randn(4, HIDDEN, 48, generator=gen), "w8a16")
    w13_codes, w13_scales = _quantized(torch.randn(4, 96, HIDDEN, generator=gen), "w8a16")
    assert refused(w13=w13_codes, w2=codes, w13_scale=w13_scales, w2_scale=scales)  # 48 features: no native int8
    assert refused(shared_gate_up=router)                               # half a shared expert


PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63)), [9]]
MAX_TOKENS = [20, 9, 24, 13, 5]  # sequences leave the decode batch at different steps


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    presets = ("mixtral", "mixtral_top1", "qwen2_moe", "qwen2_moe_top8", "qwen3_moe")
    return {p: build_moe_model(tmp_path_factory.mktemp(p), p, seed=3) for p in presets}


def _generate(model_dir: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **kwargs) -> tuple[list, list, int]:
    """(tokens, logprobs per step, decode steps the fused path took) of one engine run."""
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if fused else "0")
    taken = record_fused_steps(monkeypatch)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
              num_scheduler_steps=1, **kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], sum(taken)


@pytest.mark.parametrize("preset,quant", [
    ("mixtral", {}), ("mixtral_top1", {}), ("qwen2_moe", {}), ("qwen2_moe_top8", {}),
    ("mixtral", {"quant_type": "w8a16"}), ("qwen2_moe_top8", {"quant_type": "w8a16"}),
    ("qwen2_moe_top8", {"quant_type": "w4a16", "group_size": 32}), ("qwen3_moe", {}),
])
def test_moe_decode_through_the_fused_step_matches_the_per_op_path(moe_dirs, monkeypatch, preset, quant) -> None:
    """Greedy tokens identical and logprobs within fp32 rounding: the same products in the same order,
    only the routing's softmax and the weighted sums rounded by C instead of torch. Five sequences
    decode together (experts gathered across tokens) and leave the batch one by one (down to one token)."""
    fused_tokens, fused_logprobs, taken = _generate(moe_dirs[preset], monkeypatch, True, **quant)
    tokens, logprobs, untaken = _generate(moe_dirs[preset], monkeypatch, False, **quant)
    assert untaken == 0
    assert taken >= max(MAX_TOKENS) - 1  # every decode step went through the fused call
    assert fused_tokens == tokens
    for ours, theirs in zip(fused_logprobs, logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=2e-5)


def test_moe_models_the_block_does_not_run_keep_their_forward(moe_dirs, monkeypatch) -> None:
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    plain = LLM(str(moe_dirs["qwen2_moe"]), dtype="float32", device="cpu", block_size=16, num_kv_blocks=8,
                max_model_len=64)
    assert decode_stack.build(plain.engine.runner.model) is not None
    # int8 experts of 48 intermediate features: the native int8 kernel takes rows of whole 32-feature runs
    w8 = LLM(str(moe_dirs["qwen2_moe"]), dtype="float32", device="cpu", block_size=16, num_kv_blocks=8,
             max_model_len=64, quant_type="w8a16")
    assert decode_stack.build(w8.engine.runner.model) is None
    reference = LLM(str(moe_dirs["qwen2_moe"]), backend="reference", dtype="float32", block_size=16,
                    num_kv_blocks=8, max_model_len=64)
    assert decode_stack.build(reference.engine.runner.model) is None
