"""A8W8 (SmoothQuant) and FP8: the reference op against integer / bit-level models, the cpu paths, gating."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.cpu import quant as cpu_quant
from flashllm.ops.quant_matmul import QuantizedWeight, quant_matmul
from flashllm.ops.testing import case_quant, cases, make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.ptq.smoothquant import smooth_factors, smooth_weight
from flashllm.quant import quantize_weight
from flashllm.registry.backend import OpRequest
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import DeviceProfile
from flashllm.registry.resolve import DeviceSelection, PrecisionError, resolve_ops, select_device

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
A8W8_CASES = [c for c in cases("quant_matmul") if case_quant("quant_matmul", c) == "a8w8"]
FP8_CASES = [c for c in cases("quant_matmul") if case_quant("quant_matmul", c) == "fp8"]


# -- independent models, written from the docstrings: numpy integers and e4m3 bit patterns -------


def e4m3_table() -> np.ndarray:
    """The 127 non-negative finite e4m3fn values by code 0..126: S.EEEE.MMM, bias 7, no inf."""
    codes = np.arange(127)
    exponent, mantissa = codes >> 3, codes & 7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return np.where(exponent == 0, mantissa / 8 * 2.0**-6, normal)


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round float values (already within +-448) to the nearest e4m3 value, ties to an even code."""
    table = e4m3_table()
    mag = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(table, mag), 1, 126)
    lo = hi - 1
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(v) * table[pick]


def e4m3_decode(data: torch.Tensor) -> np.ndarray:
    """float64 values of float8_e4m3fn storage, from its bytes."""
    raw = data.view(torch.uint8).numpy().astype(np.int64)
    return np.where(raw >> 7, -1.0, 1.0) * e4m3_table()[raw & 0x7F]


def naive_inputs(x: torch.Tensor, q: QuantizedWeight) -> np.ndarray:
    """x as float32 numpy, permuted by input_perm (column k reads input feature perm[k]) and smoothed."""
    xf = x.float().numpy()
    if q.input_perm is not None:
        xf = xf[:, [int(p) for p in q.input_perm]]
    return xf / q.smooth.numpy() if q.smooth is not None else xf


def naive_a8w8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> np.ndarray:
    """Per-token int8 codes, an int64 integer product, fp32 epilogue (acc * s_x) * s_w + bias."""
    xf = naive_inputs(x, q)
    s_x = np.maximum(np.abs(xf).max(axis=1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    codes = np.clip(np.round(xf / s_x), -127, 127).astype(np.int64)
    acc = codes @ q.data.numpy().astype(np.int64).T
    out = acc.astype(np.float32) * s_x * q.scales.numpy().reshape(1, -1)
    return out + bias.float().numpy() if bias is not None else out


def naive_fp8(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> np.ndarray:
    """Per-token e4m3 codes, an exact float64 product of e4m3 values, then * s_x * s_w + bias."""
    xf = naive_inputs(x, q)
    s_x = np.maximum(np.abs(xf).max(axis=1, keepdims=True) / np.float32(448), np.finfo(np.float32).tiny)
    codes = e4m3_round(np.clip(xf / s_x, -448, 448))
    acc = codes @ e4m3_decode(q.data).T
    out = acc * s_x * q.scales.numpy().astype(np.float64).reshape(1, -1)
    return out + bias.float().numpy() if bias is not None else out


# -- the reference op ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", A8W8_CASES)
def test_a8w8_reference_is_the_integer_product(case: str) -> None:
    inputs = make_inputs("quant_matmul", torch.float32, case=case)
    x, q, bias = inputs["x"], inputs["weight"], inputs.get("bias")
    # same fp32 operations in the same order: bit for bit
    assert torch.equal(quant_matmul(x, q, bias), torch.from_numpy(naive_a8w8(x, q, bias)))
    for dtype in (torch.float16, torch.bfloat16):
        half_bias = None if bias is None else bias.to(dtype)
        expected = torch.from_numpy(naive_a8w8(x.to(dtype), q, half_bias)).to(dtype)
        assert_close(quant_matmul(x.to(dtype), q, half_bias), expected, dtype)


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_reference_is_the_e4m3_product(case: str) -> None:
    inputs = make_inputs("quant_matmul", torch.float32, case=case)
    x, q, bias = inputs["x"], inputs["weight"], inputs.get("bias")
    expected = torch.from_numpy(naive_fp8(x, q, bias)).float()
    assert_close(quant_matmul(x, q, bias), expected, torch.float32)  # the fp32 GEMM sums in another order


def test_input_perm_applies_to_every_scheme_and_cpu_path() -> None:
    """x.index_select(-1, perm) @ W.T == x @ W'.T with W'[:, perm[k]] = W[:, k], built by a loop."""
    gen = torch.Generator().manual_seed(3)
    x, perm = torch.randn(5, 64, generator=gen), torch.randperm(64, generator=gen)
    w = torch.randn(24, 64, generator=gen) / 8
    for scheme, group in (("none", -1), ("w8a16", -1), ("w4a16", 32), ("a8w8", -1), ("fp8", -1)):
        q = QuantizedWeight.dense(w) if scheme == "none" else quantize_weight(w, scheme, group)
        permuted = QuantizedWeight(q.scheme, q.data, q.scales, q.zeros, q.group_size, input_perm=perm)
        x_unpermuted = torch.empty_like(x)
        for k in range(64):  # column k of the permuted weight reads input feature perm[k]
            x_unpermuted[:, k] = x[:, perm[k]]
        expected = quant_matmul(x_unpermuted, q)
        assert torch.equal(quant_matmul(x, permuted), expected), scheme
        for path in _cpu_paths(q):
            assert_close(cpu_quant.run_path(path, x, permuted), expected, torch.float32)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 12), shift=st.integers(-8, 8))
def test_a8w8_is_per_token(seed: int, tokens: int, shift: int) -> None:
    """A token's output depends on that token alone, and scaling it by 2**shift scales the output exactly."""
    gen = torch.Generator().manual_seed(seed)
    q = quantize_weight(torch.randn(16, 32, generator=gen), "a8w8")
    x = torch.randn(tokens, 32, generator=gen)
    batch = quant_matmul(x, q)
    for path in _cpu_paths(q):
        assert torch.equal(cpu_quant.run_path(path, x, q), cpu_quant.run_path(path, x, q))
        assert_close(cpu_quant.run_path(path, x[-1:], q), batch[-1:], torch.float32)
    x_scaled = x.clone()
    x_scaled[0] *= 2.0**shift
    assert torch.equal(quant_matmul(x_scaled, q)[0], batch[0] * 2.0**shift)
    assert torch.equal(quant_matmul(x_scaled, q)[1:], batch[1:])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), scheme=st.sampled_from(["a8w8", "fp8"]))
def test_quantization_error_is_bounded(seed: int, scheme: str) -> None:
    """|y - x W.T| <= sum_k |x| e_w + |w| e_x + e_x e_w, e = half a quantization step (fp8: 2**-4 relative)."""
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(8, 48, generator=gen).double(), torch.randn(3, 48, generator=gen).double()
    q = quantize_weight(w.float(), scheme)
    exact = x @ w.T
    if scheme == "a8w8":
        e_w = (q.scales.double() / 2).expand_as(w)
        e_x = (x.abs().amax(-1, keepdim=True) / 127 / 2).expand_as(x)
    else:  # half an e4m3 step: 2**-4 relative for normals, 2**-10 * scale below 2**-6 * scale
        e_w = torch.maximum(w.abs() * 2.0**-4, q.scales.double() * 2.0**-10)
        s_x = x.abs().amax(-1, keepdim=True) / 448
        e_x = torch.maximum(x.abs() * 2.0**-4, s_x * 2.0**-10)
    bound = x.abs() @ e_w.T + e_x @ w.abs().T + e_x @ e_w.T
    assert bool(((quant_matmul(x.float(), q).double() - exact).abs() <= bound * 1.001 + 1e-6).all())


def test_smoothquant_shrinks_the_error_of_outlier_channels() -> None:
    """Activations with a few 50x channels: smoothing moves the range into the weight, error drops."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 128, generator=gen)
    x[:, :4] *= 50
    w = torch.randn(64, 128, generator=gen) / 11
    exact = x.double() @ w.double().T
    plain = quantize_weight(w, "a8w8")
    smooth = smooth_factors(x.abs().amax(0), w)
    smoothed = quantize_weight(smooth_weight(w, smooth), "a8w8", smooth=smooth)
    err_plain = (quant_matmul(x, plain).double() - exact).norm()
    err_smooth = (quant_matmul(x, smoothed).double() - exact).norm()
    assert err_smooth * 3 < err_plain, (float(err_smooth), float(err_plain))


def test_fp8_weight_codes_are_the_nearest_e4m3() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 40, generator=gen) * torch.logspace(-3, 1, 40)
    q = quantize_weight(w, "fp8")
    scaled = (w.double() / q.scales.double()).numpy()
    assert np.array_equal(e4m3_decode(q.data), e4m3_round(np.clip(scaled, -448, 448)))
    assert np.allclose(np.abs(e4m3_decode(q.data)).max(axis=1), 448)


# -- the cpu kernel --------------------------------------------------------------------------------


def _cpu_paths(q: QuantizedWeight) -> list[str]:
    if q.scheme == "a8w8":
        return ["a8w8_dequant"] + (["a8w8_fbgemm"] if cpu_quant.FBGEMM_READY else [])
    return {"none": ["dense"], "fp8": ["dense"], "w8a16": ["dequant", "int8pack"]}.get(q.scheme, ["dequant"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", A8W8_CASES)
def test_every_cpu_a8w8_path_matches_the_reference(case: str, dtype: torch.dtype) -> None:
    inputs = make_inputs("quant_matmul", dtype, case=case)
    expected = run_case(quant_matmul, "quant_matmul", inputs)
    for path in _cpu_paths(inputs["weight"]):
        actual = run_case(lambda path=path, **kw: cpu_quant.run_path(path, **kw), "quant_matmul", inputs)
        assert actual.dtype == dtype
        assert_close(actual, expected, dtype)


@pytest.mark.skipif(not cpu_quant.FBGEMM_READY, reason="fbgemm is not this torch's quantized engine")
def test_fbgemm_path_is_exact_past_fp32_integers_and_on_zero_tokens() -> None:
    """|acc| > 2**24 (all codes at +-127, K = 2048) and all-zero tokens: still the reference's numbers."""
    q = QuantizedWeight("a8w8", torch.full((8, 2048), 127, dtype=torch.int8), torch.full((8, 1), 1e-4))
    x = torch.ones(3, 2048)
    x[1] = 0
    x[2, ::2] = -1
    assert torch.equal(cpu_quant.run_path("a8w8_fbgemm", x, q), quant_matmul(x, q))
    zeros = torch.zeros(2, 2048)  # no token reaches 127: falls back to the fp32 body
    assert torch.equal(cpu_quant.run_path("a8w8_fbgemm", zeros, q), torch.zeros(2, 8))
    assert cpu_quant.run_path("a8w8_fbgemm", torch.zeros(0, 2048), q).shape == (0, 8)


def test_cpu_a8w8_path_choice_and_packed_weight_is_built_once() -> None:
    q = quantize_weight(torch.randn(32, 64), "a8w8")
    choose, limit = cpu_quant.choose_path, cpu_quant.A8W8_FBGEMM_MAX_TOKENS
    assert choose(q, 1, False, fbgemm=True) == choose(q, limit, True, fbgemm=True) == "a8w8_fbgemm"
    assert choose(q, limit + 1, False, fbgemm=True) == choose(q, 1, False, fbgemm=False) == "a8w8_dequant"
    assert choose(quantize_weight(torch.randn(32, 64), "fp8"), 1, True) == "dense"
    if cpu_quant.FBGEMM_READY:
        packed = cpu_quant.fbgemm_packed(q)
        cpu_quant.run_path("a8w8_fbgemm", torch.randn(2, 64), q)
        assert cpu_quant.fbgemm_packed(q) is packed


# -- layout validation and gating -------------------------------------------------------------------


def test_quantized_weight_validates_activation_schemes() -> None:
    codes, scales = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1)
    with pytest.raises(ValueError, match="group_size must be -1"):
        QuantizedWeight("a8w8", codes, torch.ones(4, 2), group_size=4)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        QuantizedWeight("fp8", codes, scales)
    with pytest.raises(ValueError, match="smooth must be a positive float"):
        QuantizedWeight("a8w8", codes, scales, smooth=torch.ones(4))
    with pytest.raises(ValueError, match="smooth must be a positive float"):
        QuantizedWeight("a8w8", codes, scales, smooth=torch.zeros(8))
    with pytest.raises(ValueError, match="quantize activations"):
        QuantizedWeight("w8a16", codes, scales, smooth=torch.ones(8))
    with pytest.raises(ValueError, match="not a permutation"):
        QuantizedWeight("a8w8", codes, scales, input_perm=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="group_size -1"):
        quantize_weight(torch.randn(4, 8), "a8w8", 4)
    q = QuantizedWeight("a8w8", codes, scales, smooth=torch.ones(8), input_perm=torch.arange(8))
    assert q.nbytes == 4 * 8 + 4 * 4 + 8 * 4 + 8 * 8


def test_cpu_runs_a8w8_and_refuses_fp8_naming_the_gpus_that_run_it() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    cpu = select_device("cpu", plugins=plugins)
    table = resolve_ops(cpu, OpRequest(torch.float32, torch.float32, "a8w8", 64, 16), plugins=plugins, strict=True)
    assert table.sources["quant_matmul"] == "cpu"
    with pytest.raises(PrecisionError, match=r"quantization 'fp8' is not supported .*sm89"):
        resolve_ops(cpu, OpRequest(torch.float32, torch.float32, "fp8", 64, 16), plugins=plugins)
    # a device whose profile allows fp8 gets the reference body for it
    fp8_device = DeviceProfile("fp8 device", frozenset({torch.float32}), frozenset({"none", "fp8"}))
    reference = plugins.backends()["reference"]
    selection = DeviceSelection(cpu.device, reference, fp8_device, cpu.adapter)
    table = resolve_ops(selection, OpRequest(torch.float32, torch.float32, "fp8", 64, 16), plugins=plugins,
                        strict=True)
    assert table.sources["quant_matmul"] == "reference"
