"""Op references vs independent naive computations, plus the dtype contract and input builders."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from flashllm.ops import OP_NAMES, op_specs
from flashllm.ops.fused_moe import fused_moe
from flashllm.ops.gelu_and_mul import gelu_and_mul
from flashllm.ops.quant_matmul import QuantizedWeight, quant_matmul
from flashllm.ops.rms_norm import rms_norm
from flashllm.ops.silu_and_mul import silu_and_mul
from flashllm.ops.testing import case_kv_dtype, cases, make_inputs, run_case
from flashllm.ops.tolerances import TOLERANCES, assert_close, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_formula_and_transformers(dtype: torch.dtype) -> None:
    x, weight = _randn(9, 96, dtype=dtype), _randn(96, dtype=dtype, seed=1) + 1
    expected = x.double() / (x.double().square().sum(-1, keepdim=True) / 96 + 1e-5).sqrt()
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype
    assert_close(out, (expected * weight.double()).to(dtype), dtype)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    assert_close(out, hf(x).detach(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_normed_sum_and_new_residual(dtype: torch.dtype) -> None:
    x, residual, weight = _randn(5, 64, dtype=dtype), _randn(5, 64, dtype=dtype, seed=1), _randn(64, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, x_before + residual_before)  # the sum is rounded in dtype
    assert_close(normed, rms_norm(x_before + residual_before, weight, 1e-6), dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_formula(dtype: torch.dtype) -> None:
    x = _randn(7, 2 * 40, dtype=dtype) * 3
    gate, up = x.double()[:, :40], x.double()[:, 40:]
    out = silu_and_mul(x)
    assert out.shape == (7, 40) and out.dtype == dtype
    assert_close(out, (gate / (1 + torch.exp(-gate)) * up).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_matches_formula(dtype: torch.dtype, approximate: str) -> None:
    x = _randn(5, 2 * 24, dtype=dtype) * 3
    expected = torch.empty(5, 24, dtype=torch.float64)
    for t in range(5):
        for i in range(24):
            g, u = x[t, i].item(), x[t, 24 + i].item()
            if approximate == "none":
                gelu = 0.5 * g * (1 + math.erf(g / math.sqrt(2)))
            else:
                gelu = 0.5 * g * (1 + math.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            expected[t, i] = gelu * u
    out = gelu_and_mul(x, approximate)
    assert out.dtype == dtype
    assert_close(out, expected.to(dtype), dtype)


def test_gated_activations_reject_odd_width_and_unknown_approximation() -> None:
    with pytest.raises(ValueError, match="odd"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(torch.randn(2, 8), approximate="sigmoid")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_quant_matmul_none_is_plain_linear(dtype: torch.dtype, with_bias: bool) -> None:
    x, w, b = _randn(6, 48, dtype=dtype), _randn(20, 48, dtype=dtype, seed=1) / 7, _randn(20, dtype=dtype, seed=2)
    weight = QuantizedWeight.dense(w)
    assert (weight.out_features, weight.in_features) == (20, 48)
    expected = x.double() @ w.double().T + (b.double() if with_bias else 0)
    out = quant_matmul(x, weight, b if with_bias else None)
    assert out.dtype == dtype
    assert_close(out, expected.to(dtype), dtype)


def test_quantized_weight_rejects_unknown_scheme_and_bad_shapes() -> None:
    with pytest.raises(NotImplementedError, match="w3a5"):
        QuantizedWeight(scheme="w3a5", data=torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="2-D"):
        QuantizedWeight.dense(torch.zeros(4))
    with pytest.raises(ValueError, match="features"):
        quant_matmul(torch.randn(2, 5), QuantizedWeight.dense(torch.randn(3, 4)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_per_token_loop(dtype: torch.dtype) -> None:
    tokens, hidden, inter, experts, top_k = 11, 32, 24, 5, 2
    x = _randn(tokens, hidden, dtype=dtype)
    w13 = _randn(experts, 2 * inter, hidden, dtype=dtype, seed=1) / hidden**0.5
    w2 = _randn(experts, hidden, inter, dtype=dtype, seed=2) / inter**0.5
    gen = torch.Generator().manual_seed(3)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    topk_ids[0] = torch.tensor([4, 4 - 1])  # and expert 0 may go unused: must not matter
    topk_weights = torch.rand(tokens, top_k, generator=gen)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(topk_ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            gate, up = gate_up[:inter], gate_up[inter:]
            act = gate * torch.sigmoid(gate) * up
            expected[t] += topk_weights[t, j].double() * (w2[e].double() @ act)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == dtype
    assert_close(out, expected.to(dtype), dtype)


def test_fused_moe_rejects_out_of_range_expert_ids() -> None:
    with pytest.raises(ValueError, match="outside"):
        fused_moe(
            torch.randn(2, 4), torch.randn(3, 6, 4), torch.randn(3, 4, 3), torch.ones(2, 1), torch.tensor([[0], [3]])
        )


def test_every_op_has_a_spec_with_known_request_fields() -> None:
    specs = op_specs()
    assert tuple(specs) == OP_NAMES
    for spec in specs.values():
        assert spec.reference.__doc__, f"{spec.name} needs a docstring stating shapes and numerics"


@pytest.mark.parametrize("op_name", OP_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_keep_the_activation_dtype_for_every_built_case(op_name: str, dtype: torch.dtype) -> None:
    reference = op_specs()[op_name].reference
    for case in cases(op_name):
        inputs = make_inputs(op_name, dtype, case=case, head_size=32, block_size=16)
        result = run_case(reference, op_name, inputs)
        outputs = result if isinstance(result, tuple) else (result,)
        expected = [dtype] * len(outputs)
        kv_dtype = case_kv_dtype(op_name, case)
        if kv_dtype is not None and op_name == "write_kv_cache":  # int8/fp8 codes, then float32 scales
            expected = [kv_dtype, kv_dtype] + [torch.float32] * (len(outputs) - 2)
        for output, want in zip(outputs, expected, strict=True):
            assert output.dtype == want, f"{op_name}/{case} returned {output.dtype}"
            assert torch.isfinite(output.float()).all(), f"{op_name}/{case} produced non-finite values"


def test_make_inputs_is_seeded_and_does_not_share_tensors_with_run_case() -> None:
    a = make_inputs("paged_attention", torch.float32, seed=5)
    b = make_inputs("paged_attention", torch.float32, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert not torch.equal(a["q"], make_inputs("paged_attention", torch.float32, seed=6)["q"])
    k_cache = make_inputs("write_kv_cache", torch.float32)["k_cache"].clone()
    inputs = make_inputs("write_kv_cache", torch.float32)
    new_k, _ = run_case(op_specs()["write_kv_cache"].reference, "write_kv_cache", inputs)
    assert torch.equal(inputs["k_cache"], k_cache) and not torch.equal(new_k, k_cache)


@pytest.mark.parametrize("block_size", [16, 64])
def test_attention_cases_cover_block_edges_odd_lengths_and_gqa(block_size: int) -> None:
    seq_lens, ratios = set(), set()
    for case in cases("paged_attention"):
        inputs = make_inputs("paged_attention", torch.float32, case=case, block_size=block_size)
        seq_lens.update(inputs["seq_lens"].tolist())
        ratios.add(inputs["q"].shape[1] // inputs["k_cache"].shape[2])
    assert {block_size, 2 * block_size, block_size + 1, block_size - 1, 1} <= seq_lens
    assert any(n % 2 for n in seq_lens) and ratios >= {1, 2, 4, 7}


def test_unknown_op_or_case_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="known"):
        make_inputs("softmax", torch.float32)
    with pytest.raises(KeyError, match="known"):
        make_inputs("rms_norm", torch.float32, case="huge")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerances_lie_between_one_and_a_hundred_ulps(dtype: torch.dtype) -> None:
    atol, rtol = tolerance(dtype)
    eps = torch.finfo(dtype).eps
    assert eps <= rtol <= 100 * eps
    values = torch.linspace(1, 2, 50, dtype=torch.float64)
    # assert_close must use these tolerances, not torch's defaults (tighter for fp32)
    assert_close(values.mul(1 + rtol / 2).to(dtype), values.to(dtype), dtype)
    with pytest.raises(AssertionError):
        assert_close(values.mul(1 + 4 * rtol).to(dtype), values.to(dtype), dtype)


def test_unknown_dtype_tolerance_names_known_dtypes() -> None:
    with pytest.raises(KeyError, match="bfloat16"):
        tolerance(torch.int8)
    assert set(TOLERANCES) == set(DTYPES)
