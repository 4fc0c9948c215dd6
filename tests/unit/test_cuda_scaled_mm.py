"""The cuda backend's fp8 quant_matmul: torch._scaled_mm's mapping, on a GPU where there is one, else CPU tensors."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cuda import kernels
from flashllm.backends.cuda.scaled_mm import aligned, quant_matmul
from flashllm.ops.quant_matmul import dequantize, quantize_activation_fp8
from flashllm.ops.quant_matmul import quant_matmul as reference
from flashllm.quant import quantize_weight

# sm89+ GPUs run the fp8 GEMM; the CPU implements the same call (unit per-tensor scales)
DEVICE = "cuda" if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) else "cpu"


def _fp8_weight(n: int, k: int, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    return quantize_weight((torch.randn(n, k, generator=gen) * k**-0.5).to(device), "fp8")


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_scaled_mm_path_equals_the_dequantized_fp8_product(tokens: int) -> None:
    weight = _fp8_weight(48, 64, device=DEVICE)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    bias = torch.randn(48).to(DEVICE)
    assert aligned(weight)
    codes, scales = quantize_activation_fp8(x, None)
    # independent: widen both e4m3 operands, one fp32 GEMM, then both scales
    want = (codes.float() * scales) @ dequantize(weight).T + bias
    got = quant_matmul(x, weight, bias)
    if DEVICE == "cpu":  # the CPU widens e4m3 and accumulates in IEEE fp32: the same sums
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, reference(x, weight, bias), rtol=1e-5, atol=1e-5)
        return
    # H100 fp8 tensor cores accumulate with fewer mantissa bits than IEEE fp32 (seen: 3e-4 on
    # outputs of size ~1); a wrong scale or layout errs by O(1), far above this bound
    for expected in (want, reference(x, weight, bias)):
        assert ((got - expected).norm() / expected.norm()).item() < 5e-3


def test_unaligned_shapes_and_other_schemes_take_the_reference_body(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1))
    odd = _fp8_weight(40, 24)  # 24 is not a multiple of 16
    x = torch.randn(3, 24)
    torch.testing.assert_close(quant_matmul(x, odd), reference(x, odd))
    w8 = quantize_weight(torch.randn(32, 32), "w8a16")
    x8 = torch.randn(2, 32)
    torch.testing.assert_close(quant_matmul(x8, w8), reference(x8, w8))
    assert calls == []


def test_the_fp8_kernel_is_registered_for_fp8_only_and_half_dtypes() -> None:
    assert kernels.FP8_CAPS.quant == frozenset({"fp8"})
    assert torch.float32 not in kernels.FP8_CAPS.dtypes
