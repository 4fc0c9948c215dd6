"""gpt-oss's two kernel capabilities: attention sinks (a per-head logit that joins each softmax and attends to
nothing) and biased experts with the clamped "swigluoai" activation. The reference computes both as written out
here; kernels whose Caps do not claim them are never bound for such a model and refuse them given directly."""

from __future__ import annotations

import math

import pytest
import torch

from flashllm.backends import cuda, ggml, npu, xla
from flashllm.backends.cpu import kernels as cpu_kernels
from flashllm.backends.cpu import moe as cpu_moe
from flashllm.backends.xla import kernels as xla_kernels
from flashllm.ops import op_specs
from flashllm.ops.fused_moe import fused_moe
from flashllm.ops.paged_attention import paged_attention
from flashllm.ops.testing import make_inputs, run_case
from flashllm.registry.backend import Backend, Caps, OpRequest
from flashllm.registry.resolve import KernelResolutionError, resolve_ops
from flashllm.testing.backends import cpu_selection

FP32 = frozenset({torch.float32})


def test_a_sink_takes_its_share_of_the_softmax_and_adds_no_value() -> None:
    """One query over two keys, written out: exp(s_i) / (exp(s_0) + exp(s_1) + exp(sink)) weighting the values."""
    q = torch.tensor([[[2.0, 0.0]]])  # (T=1, Hq=1, D=2)
    keys, values = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    args = (q, keys.view(1, 2, 1, 2), values.view(1, 2, 1, 2), torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1.0)
    sink = 1.5
    denominator = math.exp(2.0) + math.exp(0.0) + math.exp(sink)
    expected = (math.exp(2.0) * values[0] + math.exp(0.0) * values[1]) / denominator
    torch.testing.assert_close(paged_attention(*args, sinks=torch.tensor([sink]))[0, 0], expected)
    with pytest.raises(ValueError, match="sinks must be float of shape"):
        paged_attention(*args, sinks=torch.tensor([1.0, 2.0]))


def test_the_cpu_kernel_claims_sinks_and_computes_the_reference() -> None:
    inputs = make_inputs("paged_attention", torch.float32, head_size=64, block_size=16, case="sinks")
    reference = run_case(op_specs()["paged_attention"].reference, "paged_attention", inputs)
    torch.testing.assert_close(run_case(cpu_kernels.paged_attention, "paged_attention", inputs), reference)
    sinkless = run_case(op_specs()["paged_attention"].reference, "paged_attention",
                        {k: v for k, v in inputs.items() if k != "sinks"})
    assert (sinkless - reference).abs().max() > 1e-2  # the case's sinks move its outputs


def _oai_expert(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor) -> torch.Tensor:
    """One gpt-oss expert as transformers' GptOssExperts computes it, on gate rows then up rows."""
    gate, up = (x @ w13.T + b13).chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w2.T + b2


def test_biased_swigluoai_experts_are_gpt_oss_experts() -> None:
    inputs = make_inputs("fused_moe", torch.float32, case="swigluoai_bias")
    out = run_case(op_specs()["fused_moe"].reference, "fused_moe", inputs)
    x, ids, weights = inputs["x"], inputs["topk_ids"], inputs["topk_weights"]
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            expected[t] += weights[t, slot] * _oai_expert(x[t], inputs["w13"][e], inputs["w13_bias"][e],
                                                           inputs["w2"][e], inputs["w2_bias"][e])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    gate = torch.einsum("th,eih->tei", x, inputs["w13"])[..., :inputs["w2"].shape[2]]
    assert (gate > 7.0).any()  # the case reaches the clamp
    silu = run_case(fused_moe, "fused_moe", {**inputs, "activation": "silu"})
    assert (silu - out).abs().max() > 1e-2
    with pytest.raises(ValueError, match="activation 'gelu' is not one of"):
        run_case(fused_moe, "fused_moe", {**inputs, "activation": "gelu"})
    with pytest.raises(ValueError, match="w2_bias must be float of shape"):
        run_case(fused_moe, "fused_moe", {**inputs, "w2_bias": inputs["w2_bias"][:, :-1]})


@pytest.mark.parametrize("case", ["swigluoai_bias", "swigluoai_bias_one_token"])
def test_the_cpu_moe_kernel_runs_gpt_oss_experts(case: str) -> None:
    inputs = make_inputs("fused_moe", torch.float32, case=case)
    torch.testing.assert_close(run_case(cpu_moe.fused_moe, "fused_moe", inputs),
                               run_case(op_specs()["fused_moe"].reference, "fused_moe", inputs))


def test_the_cpu_moe_kernel_runs_int8_gpt_oss_experts() -> None:
    """int8 codes with per-channel scales (the native int8 products for 64-feature rows) beside float biases."""
    inputs = make_inputs("fused_moe", torch.float32, case="w8a16_top2")
    gen = torch.Generator().manual_seed(0)
    experts, two_inter, hidden = inputs["w13"].shape
    inputs.update(w13_bias=torch.randn(experts, two_inter, generator=gen),
                  w2_bias=torch.randn(experts, hidden, generator=gen), activation="swigluoai")
    out = run_case(cpu_moe.fused_moe, "fused_moe", inputs)
    torch.testing.assert_close(out, run_case(op_specs()["fused_moe"].reference, "fused_moe", inputs),
                               rtol=1e-4, atol=1e-4)
    unbiased = run_case(op_specs()["fused_moe"].reference, "fused_moe", {**inputs, "w13_bias": None, "w2_bias": None})
    assert (unbiased - out).abs().max() > 0.1


def test_sinks_and_swigluoai_fall_back_to_the_reference_visibly_or_strict_refuses() -> None:
    backend = Backend(name="plain", device_type="cpu", priority=1)
    backend.kernel("paged_attention", Caps(dtypes=FP32, kv_dtypes=FP32))(op_specs()["paged_attention"].reference)
    backend.kernel("fused_moe", Caps(dtypes=FP32))(op_specs()["fused_moe"].reference)
    selection, plugins = cpu_selection(backend, FP32)
    request = OpRequest(torch.float32, torch.float32, "none", 64, 16, sinks=True, moe_activation="swigluoai")
    table = resolve_ops(selection, request, plugins=plugins)
    assert table.sources["paged_attention"] == "reference" and table.kernel("paged_attention").caps.sinks
    assert table.sources["fused_moe"] == "reference"
    reasons = {f.op: f.reason for f in table.fallbacks}
    assert "sinks" in reasons["paged_attention"] and "swigluoai" in reasons["fused_moe"]
    with pytest.raises(KernelResolutionError, match="sinks"):
        resolve_ops(selection, request, plugins=plugins, strict=True)
    plain = resolve_ops(selection, OpRequest(torch.float32, torch.float32, "none", 64, 16), plugins=plugins)
    assert plain.sources["paged_attention"] == plain.sources["fused_moe"] == "plain"


@pytest.mark.parametrize("make_backend", [npu.make_backend, xla.make_backend, ggml.make_backend],
                         ids=["npu", "xla", "ggml"])
def test_kernels_without_sinks_do_not_claim_them(make_backend) -> None:
    uses = op_specs()["paged_attention"].uses
    for kernel in make_backend().kernels["paged_attention"]:
        request = OpRequest(next(iter(kernel.caps.dtypes)), None, "none", 64, 16, sinks=True)
        assert "has sinks" in kernel.mismatch(request, uses)


def test_the_triton_kernels_claim_gpt_oss_s_experts_and_sinks() -> None:
    """Claimed, so bound for gpt-oss on cuda: tests/conformance/test_triton_interpret.py checks both against the
    reference under TRITON_INTERPRET=1."""
    (moe,) = cuda.make_backend().kernels["fused_moe"]
    assert moe.mismatch(OpRequest(torch.float32, None, "none", moe_activation="swigluoai"),
                        op_specs()["fused_moe"].uses) is None
    (attention,) = cuda.make_backend().kernels["paged_attention"]
    assert attention.mismatch(OpRequest(torch.float32, None, "none", 64, 16, sinks=True),
                              op_specs()["paged_attention"].uses) is None


def test_sinks_given_to_a_kernel_that_does_not_claim_them_are_refused() -> None:
    inputs = make_inputs("paged_attention", torch.float32, head_size=64, block_size=16, case="sinks")
    with pytest.raises(NotImplementedError, match="does not add attention sinks"):
        run_case(xla_kernels.paged_attention, "paged_attention", inputs)
