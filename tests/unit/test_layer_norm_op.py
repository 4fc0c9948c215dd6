"""ops.layer_norm vs a float64 formula, torch's nn.LayerNorm and Cohere's bias-free LayerNorm; the residual contract."""

from __future__ import annotations

import pytest
import torch
from transformers.models.cohere.modeling_cohere import CohereLayerNorm

from flashllm.ops.layer_norm import layer_norm
from flashllm.ops.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2 + shift).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_formula_and_torch(dtype: torch.dtype) -> None:
    x = _randn(9, 96, dtype=dtype, shift=3.0)  # off-centre rows: the mean matters
    weight, bias = _randn(96, dtype=dtype, seed=1) + 1, _randn(96, dtype=dtype, seed=2)
    xd = x.double()
    centered = xd - xd.mean(-1, keepdim=True)
    expected = centered / (centered.square().mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double() + bias.double()
    out = layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == dtype
    assert_close(out, expected.to(dtype), dtype)
    torch_norm = torch.nn.LayerNorm(96, eps=1e-5).to(dtype)
    torch_norm.weight.data.copy_(weight)
    torch_norm.bias.data.copy_(bias)
    assert_close(out, torch_norm(x).detach(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_without_bias_is_coheres_layer_norm(dtype: torch.dtype) -> None:
    x, weight = _randn(4, 64, dtype=dtype, shift=-2.0), _randn(64, dtype=dtype, seed=3) + 1
    hf = CohereLayerNorm(64, eps=1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    assert_close(layer_norm(x, weight, None, 1e-5), hf(x).detach(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_with_residual_returns_normed_sum_and_new_residual(dtype: torch.dtype) -> None:
    x, residual = _randn(5, 64, dtype=dtype), _randn(5, 64, dtype=dtype, seed=1)
    weight, bias = _randn(64, dtype=dtype, seed=2), _randn(64, dtype=dtype, seed=3)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = layer_norm(x, weight, bias, 1e-6, residual)
    assert torch.equal(new_residual, x_before + residual_before)  # the sum is rounded in dtype
    assert torch.equal(normed, layer_norm(x_before + residual_before, weight, bias, 1e-6))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_layer_norm_refuses_a_weight_or_bias_of_another_width() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="hidden size 8 but weight has 6"):
        layer_norm(x, torch.ones(6), None, 1e-5)
    with pytest.raises(ValueError, match="bias 7"):
        layer_norm(x, torch.ones(8), torch.zeros(7), 1e-5)
