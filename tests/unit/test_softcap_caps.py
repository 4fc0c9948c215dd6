"""Attention score capping (Gemma 2's attn_logit_softcapping) as a kernel capability: the reference computes
c * tanh(score / c) before the mask and softmax; kernels whose Caps do not claim it are never bound for such a
model (the reference runs instead, recorded as a fallback) and refuse a cap given to them directly."""

from __future__ import annotations

import math

import pytest
import torch

from flashllm.backends import cuda, ggml, npu, xla
from flashllm.backends.cpu import kernels as cpu_kernels
from flashllm.backends.xla import kernels as xla_kernels
from flashllm.backends.xpu import native as xpu_native
from flashllm.ops import op_specs
from flashllm.ops.paged_attention import paged_attention
from flashllm.ops.testing import make_inputs, run_case
from flashllm.registry.backend import Backend, Caps, OpRequest
from flashllm.registry.resolve import DeviceSelection, KernelResolutionError, resolve_ops
from flashllm.testing.backends import cpu_selection

FP32 = frozenset({torch.float32})
USES = op_specs()["paged_attention"].uses




def test_the_reference_caps_each_score_before_the_softmax() -> None:
    """One query over three keys, written out: softmax(c * tanh(q.k * scale / c)) weighting the values."""
    q = torch.tensor([[[3.0, 1.0]]])  # (T=1, Hq=1, D=2)
    keys = torch.tensor([[4.0, 0.0], [0.0, 2.0], [-1.0, 1.0]])
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    k_cache, v_cache = keys.view(1, 3, 1, 2), values.view(1, 3, 1, 2)
    args = (q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), 0.5)
    scores = [0.5 * float(q[0, 0] @ k) for k in keys]
    capped = [2.0 * math.tanh(s / 2.0) for s in scores]
    weights = torch.softmax(torch.tensor(capped), dim=0)
    torch.testing.assert_close(paged_attention(*args, logit_softcap=2.0)[0, 0], weights @ values)
    plain = torch.softmax(torch.tensor(scores), dim=0) @ values
    torch.testing.assert_close(paged_attention(*args)[0, 0], plain)
    assert (weights @ values - plain).abs().max() > 0.05  # the cap moved the result
    with pytest.raises(ValueError, match="logit_softcap must be positive"):
        paged_attention(*args, logit_softcap=0.0)


def test_the_cuda_kernel_claims_the_cap() -> None:
    """The Triton kernel caps scores itself (checked against the reference under TRITON_INTERPRET=1 in
    tests/conformance/test_triton_interpret.py)."""
    (kernel,) = cuda.make_backend().kernels["paged_attention"]
    assert kernel.caps.softcap and kernel.mismatch(OpRequest(torch.float32, None, "none", 64, 16, softcap=True),
                                                   USES) is None


def test_the_cpu_kernel_claims_the_cap_and_computes_the_reference() -> None:
    inputs = make_inputs("paged_attention", torch.float32, head_size=64, block_size=16, case="softcap")
    reference = run_case(op_specs()["paged_attention"].reference, "paged_attention", inputs)
    torch.testing.assert_close(run_case(cpu_kernels.paged_attention, "paged_attention", inputs), reference)
    uncapped = run_case(op_specs()["paged_attention"].reference, "paged_attention",
                        {k: v for k, v in inputs.items() if k != "logit_softcap"})
    assert (uncapped - reference).abs().max() > 1e-2  # the case's cap bends its scores


def _selection_without_softcap() -> tuple[DeviceSelection, object]:
    backend = Backend(name="no-softcap", device_type="cpu", priority=1)
    backend.kernel("paged_attention", Caps(dtypes=FP32, kv_dtypes=FP32, alibi=True))(
        op_specs()["paged_attention"].reference)
    return cpu_selection(backend, FP32)


def test_a_capped_model_falls_back_to_the_reference_visibly_or_strict_refuses() -> None:
    selection, plugins = _selection_without_softcap()
    request = OpRequest(torch.float32, torch.float32, "none", 64, 16, softcap=True)
    table = resolve_ops(selection, request, plugins=plugins)
    assert table.sources["paged_attention"] == "reference" and table.kernel("paged_attention").caps.softcap
    (fallback,) = [f for f in table.fallbacks if f.op == "paged_attention"]
    assert "logit_softcap" in fallback.reason
    with pytest.raises(KernelResolutionError, match="caps attention scores"):
        resolve_ops(selection, request, plugins=plugins, strict=True)


@pytest.mark.parametrize("make_backend", [npu.make_backend, xla.make_backend, ggml.make_backend],
                         ids=["npu", "xla", "ggml"])
def test_kernels_without_the_cap_do_not_claim_it(make_backend) -> None:
    for kernel in make_backend().kernels["paged_attention"]:
        request = OpRequest(next(iter(kernel.caps.dtypes)), None, "none", 64, 16, softcap=True)
        assert "caps attention scores" in kernel.mismatch(request, USES)


@pytest.mark.parametrize("kernel", [xpu_native.paged_attention, xla_kernels.paged_attention],
                         ids=["xpu", "xla"])
def test_a_cap_given_to_a_kernel_that_does_not_claim_it_is_refused(kernel) -> None:
    inputs = make_inputs("paged_attention", torch.float32, head_size=64, block_size=16, case="softcap")
    with pytest.raises(NotImplementedError, match="does not cap attention scores"):
        run_case(kernel, "paged_attention", inputs)
