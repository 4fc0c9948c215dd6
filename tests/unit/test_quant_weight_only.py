"""Weight-only int8/int4: quantize/dequantize bounds, int4 packing, the reference op and every cpu kernel path."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.cpu import native
from flashllm.backends.cpu import quant as cpu_quant
from flashllm.ops.quant_matmul import QuantizedWeight, quant_matmul
from flashllm.ops.testing import case_quant, cases, make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.quant import (
    QuantConfigError,
    WeightQuantSpec,
    dequantize,
    pack_int4,
    quantize_weight,
    unpack_int4,
    weight_quant_spec,
)
from flashllm.registry.backend import Backend, Caps, OpRequest
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import DeviceProfile
from flashllm.registry.resolve import (
    DeviceSelection,
    KernelResolutionError,
    PrecisionError,
    check_precision,
    resolve_ops,
    select_device,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT_ONLY_CASES = [c for c in cases("quant_matmul") if case_quant("quant_matmul", c) in ("w8a16", "w4a16")]
# (scheme, symmetric) -> (lowest code, highest code, implicit zero point or None for explicit zeros)
SCHEMES = {("w8a16", True): (-127, 127, 0), ("w4a16", True): (0, 15, 8), ("w4a16", False): (0, 15, None)}


# -- independent model of the format: numpy, written from the docstring, not from the code ---------


def naive_codes(q: QuantizedWeight) -> np.ndarray:
    """(N, K) int64 codes: int8 as stored; int4 byte b holds code b % 16 (even k) and b // 16 (odd k)."""
    data = q.data.numpy().astype(np.int64)
    if q.scheme == "w8a16":
        return data
    codes = np.empty((data.shape[0], data.shape[1] * 2), dtype=np.int64)
    codes[:, 0::2], codes[:, 1::2] = data % 16, data // 16
    return codes


def naive_dequantize(q: QuantizedWeight) -> np.ndarray:
    """(N, K) float32: (code - zero) * scale element by element, zero 8 for symmetric int4."""
    codes = naive_codes(q)
    n, k = codes.shape
    size = k if q.group_size == -1 else q.group_size
    scales = q.scales.numpy()
    zeros = None if q.zeros is None else q.zeros.numpy()
    out = np.empty((n, k), dtype=np.float32)
    for row in range(n):
        for col in range(k):
            group = col // size
            zero = 0 if q.scheme == "w8a16" else (8 if zeros is None else int(zeros[row, group]))
            out[row, col] = np.float32(codes[row, col] - zero) * scales[row, group]
    return out


def expected_scales(w: np.ndarray, scheme: str, symmetric: bool, group_size: int) -> np.ndarray:
    """Scales from the documented rule: max|w|/127, max|w|/7, or (max(w,0) - min(w,0))/15 per group."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    groups = w.reshape(n, k // size, size).astype(np.float64)
    if symmetric:
        return np.abs(groups).max(-1) / (127 if scheme == "w8a16" else 7)
    return (np.maximum(groups.max(-1), 0) - np.minimum(groups.min(-1), 0)) / 15


# -- quantize / dequantize ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(sorted(SCHEMES)),
    n=st.integers(1, 6),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([-1, 2, 8, 32]),
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    shift=st.sampled_from([0.0, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_at_most_half_a_step_and_codes_are_nearest(
    scheme, n, groups, group_size, magnitude, shift, seed
) -> None:
    name, symmetric = scheme
    k = groups * (group_size if group_size != -1 else 8)
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) + shift) * magnitude  # shift: one-sided groups for asymmetric
    q = quantize_weight(w, name, group_size, symmetric)
    lo, hi, zero = SCHEMES[scheme]
    scales = expected_scales(w.numpy(), name, symmetric, group_size)
    np.testing.assert_allclose(q.scales.numpy(), scales, rtol=1e-6)
    codes = naive_codes(q)
    assert codes.min() >= lo and codes.max() <= hi
    deq = naive_dequantize(q)
    np.testing.assert_array_equal(dequantize(q).numpy(), deq)
    size = k if group_size == -1 else group_size
    step = np.repeat(q.scales.numpy().astype(np.float64), size, axis=1)  # (N, K) per-element scale
    error = np.abs(w.numpy().astype(np.float64) - deq)
    assert (error <= step / 2 * (1 + 1e-5) + 1e-30).all(), float((error / step).max())
    # no other representable code is closer: one step up or down is never better
    zeros = np.repeat(q.zeros.numpy() if q.zeros is not None else np.full(q.scales.shape, zero), size, axis=1)
    for delta in (-1, 1):
        other = codes + delta
        valid = (other >= lo) & (other <= hi)
        other_error = np.abs(w.numpy() - (other - zeros) * step)
        assert (error[valid] <= other_error[valid] + step[valid] * 1e-5).all()


def test_all_zero_groups_and_rejected_inputs() -> None:
    w = torch.zeros(3, 64)
    w[1, 32:] = torch.linspace(-1, 1, 32)
    for scheme, symmetric in SCHEMES:
        q = quantize_weight(w, scheme, 32, symmetric)
        assert torch.isfinite(q.scales).all()
        assert torch.equal(dequantize(q)[0], torch.zeros(64))
    with pytest.raises(ValueError, match="does not divide in_features 64"):
        quantize_weight(w, "w4a16", 48)
    with pytest.raises(ValueError, match="symmetric only"):
        quantize_weight(w, "w8a16", -1, symmetric=False)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weight(torch.tensor([[1.0, float("inf")]]), "w8a16")
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_weight(w, "w3a16")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), half_k=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_pack_int4_layout_and_round_trip(n: int, half_k: int, seed: int) -> None:
    codes = torch.randint(0, 16, (n, 2 * half_k), generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (n, half_k)
    for row in range(n):
        for j in range(half_k):
            assert int(packed[row, j]) == int(codes[row, 2 * j]) + 16 * int(codes[row, 2 * j + 1])
    assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


def test_quantized_weight_validates_its_layout() -> None:
    scales = torch.ones(4, 1)
    with pytest.raises(ValueError, match="int8"):
        QuantizedWeight("w8a16", torch.zeros(4, 8, dtype=torch.uint8), scales)
    with pytest.raises(ValueError, match=r"scales of shape \(4, 2\)"):
        QuantizedWeight("w8a16", torch.zeros(4, 8, dtype=torch.int8), scales, group_size=4)
    with pytest.raises(ValueError, match="positive divisor"):
        QuantizedWeight("w4a16", torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 2), group_size=3)
    with pytest.raises(ValueError, match="symmetric"):
        QuantizedWeight("w8a16", torch.zeros(4, 8, dtype=torch.int8), scales, torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="integer codes"):
        QuantizedWeight("w4a16", torch.zeros(4, 4, dtype=torch.uint8), scales, torch.zeros(4, 1))
    q = QuantizedWeight("w4a16", torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 2), group_size=4)
    assert (q.out_features, q.in_features, q.num_groups, q.nbytes) == (4, 8, 2, 4 * 4 + 4 * 2 * 4)


# -- the reference op ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", WEIGHT_ONLY_CASES)
def test_reference_is_x_times_dequantized_weight(case: str) -> None:
    inputs = make_inputs("quant_matmul", torch.float32, case=case)
    x, q, bias = inputs["x"], inputs["weight"], inputs.get("bias")
    w = torch.from_numpy(naive_dequantize(q))
    expected = x @ w.T + (0 if bias is None else bias)
    assert torch.equal(quant_matmul(x, q, bias), expected)  # fp32: the same products, bit for bit
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    for dtype in (torch.float16, torch.bfloat16):
        out = quant_matmul(x.to(dtype), q, None if bias is None else bias.to(dtype))
        half_x = x.to(dtype).double() @ w.double().T + (0 if bias is None else bias.to(dtype).double())
        assert out.dtype == dtype
        assert_close(out, half_x.to(dtype), dtype)
    assert_close(quant_matmul(x, q, bias), exact.float(), torch.float32)


# -- the cpu kernel: every body, forced, against the reference ------------------------------------


def _paths(weight: QuantizedWeight) -> list[str]:
    paths = ["dequant"]
    if native.library() is not None and native.supports_quantized(weight, 1):
        paths.append("native")
    if weight.scheme == "w8a16" and weight.num_groups == 1:
        paths.append("int8pack")
    if weight.scheme == "w4a16" and cpu_quant.int4pack_supported(weight):
        paths.append("int4pack")
    return paths


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WEIGHT_ONLY_CASES)
def test_every_cpu_path_matches_the_reference(case: str, dtype: torch.dtype) -> None:
    """The packed bodies run in the engine only on AVX512; here they are forced on whatever CPU this is."""
    inputs = make_inputs("quant_matmul", dtype, case=case)
    expected = run_case(quant_matmul, "quant_matmul", inputs)
    for path in _paths(inputs["weight"]):
        actual = run_case(lambda path=path, **kw: cpu_quant.run_path(path, **kw), "quant_matmul", inputs)
        assert actual.dtype == dtype
        if path == "native" and native.int8_activations(inputs["weight"]):
            # that kernel rounds the activations to int8 first (its one approximation, bounded in
            # test_cpu_native.py); on the same rounded activations it is the reference's fp32 product
            rounded = cpu_quant.rounded_inputs(inputs)
            assert rounded is not inputs  # decode-sized: the engine would take this path too
            assert_close(actual, run_case(quant_matmul, "quant_matmul", rounded).to(dtype), dtype)
        else:
            assert_close(actual, expected, dtype)


def test_packed_paths_are_reached_somewhere() -> None:
    reached = {p for c in WEIGHT_ONLY_CASES for p in _paths(make_inputs("quant_matmul", torch.float32, case=c)["weight"])}
    native_reached = {"native"} if native.library() is not None else set()
    assert reached == {"dequant", "int8pack", "int4pack"} | native_reached


def test_cpu_path_choice() -> None:
    w8 = quantize_weight(torch.randn(32, 64), "w8a16")
    w8_grouped = quantize_weight(torch.randn(32, 64), "w8a16", 32)
    w4 = quantize_weight(torch.randn(32, 64), "w4a16", 32)
    w4_odd_n = quantize_weight(torch.randn(24, 64), "w4a16", 32)
    w4_small_group = quantize_weight(torch.randn(32, 64), "w4a16", 16)
    dense = QuantizedWeight.dense(torch.randn(32, 64))
    choose = functools.partial(cpu_quant.choose_path, native_ready=False)
    assert choose(dense, 1, True) == "dense"
    assert [choose(w, 1, False) for w in (w8, w4)] == ["dequant", "dequant"]
    assert [choose(w, 1, True) for w in (w8, w4)] == ["int8pack", "int4pack"]
    assert choose(w8, cpu_quant.PACKED_MAX_TOKENS + 1, True) == "dequant"
    assert [choose(w, 1, True) for w in (w8_grouped, w4_odd_n, w4_small_group)] == ["dequant"] * 3


def test_int4_tile_layout_is_built_once_per_dtype() -> None:
    q = quantize_weight(torch.randn(32, 128), "w4a16", 64, symmetric=False)
    x = torch.randn(2, 128)
    cpu_quant.run_path("int4pack", x, q)
    packed, _ = cpu_quant.int4pack_layout(q, torch.float32)
    cpu_quant.run_path("int4pack", x, q)
    assert cpu_quant.int4pack_layout(q, torch.float32)[0] is packed
    assert cpu_quant.int4pack_layout(q, torch.bfloat16)[0] is packed  # codes shared, scales per dtype


# -- configuration and capability gating -----------------------------------------------------------


def test_quant_type_spellings() -> None:
    assert weight_quant_spec("weight_only_int8") == weight_quant_spec("W8A16") == WeightQuantSpec("w8a16")
    assert weight_quant_spec("weight_only_int4", 128) == WeightQuantSpec("w4a16", 128, True)
    assert weight_quant_spec("w4a16_asym", 64) == WeightQuantSpec("w4a16", 64, False)
    assert not weight_quant_spec("none", 64).enabled
    assert weight_quant_spec("a8w8") == weight_quant_spec("W8A8") == weight_quant_spec("smoothquant") == \
        WeightQuantSpec("a8w8")
    assert weight_quant_spec("a8w8_fp8") == weight_quant_spec("fp8") == WeightQuantSpec("fp8")
    with pytest.raises(QuantConfigError, match="one weight scale per output channel"):
        weight_quant_spec("a8w8", 64)
    with pytest.raises(QuantConfigError, match="weight_only_int8"):
        weight_quant_spec("int3")
    with pytest.raises(QuantConfigError, match="group"):
        weight_quant_spec("w4a16", 0)


def test_cpu_resolves_weight_only_schemes_to_its_own_kernel() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    selection = select_device("cpu", plugins=plugins)
    for scheme in ("w8a16", "w4a16"):
        table = resolve_ops(selection, OpRequest(torch.float32, torch.float32, scheme, 64, 16), plugins=plugins,
                            strict=True)
        assert table.sources["quant_matmul"] == "cpu"


def test_devices_and_kernels_that_cannot_run_a_scheme_say_so() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    cpu = select_device("cpu", plugins=plugins)
    no_int4 = DeviceProfile("int8-only device", frozenset({torch.float32}), frozenset({"none", "w8a16"}))
    with pytest.raises(PrecisionError, match="quantization 'w4a16' is not supported on .*int8-only device"):
        check_precision(DeviceSelection(cpu.device, cpu.backend, no_int4, cpu.adapter), torch.float32, "w4a16")
    limited = Backend("limited", "cpu", 1)
    limited.kernel("quant_matmul", Caps(dtypes=frozenset({torch.float32})))(quant_matmul)
    selection = DeviceSelection(cpu.device, limited, cpu.profile, cpu.adapter)
    with pytest.raises(KernelResolutionError, match="quant 'w8a16' not in"):
        resolve_ops(selection, OpRequest(torch.float32, torch.float32, "w8a16", 64, 16), plugins=plugins, strict=True)
