"""GGUF quantized tensors: flashllm's layouts dequantize to the gguf package's exact bits, and multiply within fp32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from flashllm.ops.quant_matmul import AFFINE_CAPABILITY, dequantize, quant_matmul  # noqa: E402
from flashllm.quant.gguf_blocks import SUPPORTED_TYPES, request_quant, row_bytes, weight_from_gguf  # noqa: E402

T = GGMLQuantizationType
TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
# byte offsets of each type's fp16 scale fields in a block (d; then dmin or m where the type has one)
HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,), T.MXFP4: ()}
# extreme fp16 scales: zero, minus zero, the smallest subnormal, a larger subnormal, the smallest
# normal, ordinary, negative, the largest finite and its negative
EXTREME_HALVES = np.array([0.0, -0.0, 2.0**-24, 3 * 2.0**-20, 2.0**-14, 1.0, -0.3, 65504.0, -65504.0], np.float16)
# byte offsets of each type's e8m0 exponent (MXFP4's 2^(e - 127)); extreme ones: 2^-127 (ggml's subnormal half),
# 2^-126, tiny, one, large, the largest finite
E8M0_FIELDS = {T.MXFP4: (0,)}
EXTREME_EXPONENTS = np.array([0, 1, 20, 127, 200, 254], np.uint8)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n: int, k: int, extreme: bool) -> np.ndarray:
    """(n, row bytes) uint8: random codes and sub-block scales, fp16 fields drawn from EXTREME_HALVES
    (extreme) or moderate finite values; never a NaN or infinite field."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    for start in HALF_FIELDS[qtype]:
        if extreme:
            halves = rng.choice(EXTREME_HALVES, size=raw.shape[0])
        else:
            halves = (rng.uniform(0.5, 1.5, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0]) / k).astype(np.float16)
        raw[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    for start in E8M0_FIELDS.get(qtype, ()):  # moderate: 2^-9 .. 2^0 around codes of up to 6
        raw[:, start] = rng.choice(EXTREME_EXPONENTS, raw.shape[0]) if extreme else rng.integers(118, 128, raw.shape[0])
    return raw.reshape(n, -1)


def _oracle(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(all="ignore"):  # huge scales times codes overflow to inf in both: the bits still agree
        return gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("extreme", [True, False], ids=["extreme", "moderate"])
def test_random_blocks_dequantize_to_the_gguf_bits(qtype: GGMLQuantizationType, extreme: bool) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + extreme)
    n, k = 24, 512
    raw = _random_blocks(rng, qtype, n, k, extreme)
    weight = weight_from_gguf(raw, qtype, (n, k))
    want = _oracle(raw, qtype)
    got = dequantize(weight).numpy()
    assert got.shape == want.shape == (n, k)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _quantizable(qtype: GGMLQuantizationType) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, GGML_QUANT_SIZES[qtype][0]), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("qtype", [t for t in TYPES if _quantizable(t)], ids=lambda t: t.name)
def test_gguf_quantized_rows_dequantize_to_the_gguf_bits(qtype: GGMLQuantizationType) -> None:
    """Real quantizer output (where the gguf package has one), rows at extreme magnitudes: subnormal
    and zero scales, huge ones, all-negative and constant rows."""
    rng = np.random.default_rng(int(qtype))
    k = 256
    magnitudes = np.array([1e-9, 1e-6, 3e-5, 1e-2, 1.0, 100.0, 7e3, 0.0], np.float32)
    rows = rng.standard_normal((len(magnitudes) + 2, k)).astype(np.float32)
    rows[: len(magnitudes)] *= magnitudes[:, None]
    rows[-2] = -np.abs(rows[-2])  # all negative: Q4_1's minimum carries the row
    rows[-1] = 0.25               # constant
    raw = gguf.quants.quantize(rows, qtype)
    weight = weight_from_gguf(raw, qtype, rows.shape)
    np.testing.assert_array_equal(_bits(dequantize(weight).numpy()), _bits(_oracle(raw, qtype)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_quant_matmul_is_x_times_the_dequantized_weight(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    n, k, tokens = 40, 768, 3
    raw = _random_blocks(rng, qtype, n, k, extreme=False)
    weight = weight_from_gguf(raw, qtype, (n, k))
    w = torch.from_numpy(_oracle(raw, qtype)).double()
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(int(qtype)))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ w.T + bias.double()
    got = quant_matmul(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (tokens, n)
    # fp32 rounding of a K-term dot product: at most about K ulps of the sum of |terms|
    bound = k * 2.0**-24 * (x.double().abs() @ w.abs().T + bias.double().abs())
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert torch.equal(got, torch.nn.functional.linear(x, dequantize(weight), bias))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_readers_tensor_data_is_what_weight_from_gguf_takes(qtype: GGMLQuantizationType, tmp_path) -> None:
    """The contract with the GGUF loader: a tensor written by gguf.GGUFWriter and read back by
    gguf.GGUFReader goes in as ReaderTensor.data with shape (out, in) = (ne[1], ne[0])."""
    rng = np.random.default_rng(int(qtype))
    n, k = 8, 512
    raw = _random_blocks(rng, qtype, n, k, extreme=False)
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == qtype and [int(v) for v in tensor.shape] == [k, n]
    weight = weight_from_gguf(tensor.data, tensor.tensor_type, (int(tensor.shape[1]), int(tensor.shape[0])))
    np.testing.assert_array_equal(_bits(dequantize(weight).numpy()), _bits(_oracle(raw, qtype)))


def test_layouts_and_their_bytes() -> None:
    """The representation per type, and what it costs against the file's bytes (docs quote this)."""
    n, k = 4, 256
    rng = np.random.default_rng(0)
    expected = {  # scheme, group, scale dtype, offsets, stored bytes per 256 features of a row
        T.Q8_0: ("w8a16", 32, torch.float16, False, 256 + 8 * 2),
        T.Q4_0: ("w4a16", 32, torch.float16, False, 128 + 8 * 2),
        T.Q4_1: ("w4a16", 32, torch.float16, True, 128 + 8 * 4),
        T.Q5_0: ("w8a16", 32, torch.float16, False, 256 + 8 * 2),
        T.Q5_1: ("w8a16", 32, torch.float16, True, 256 + 8 * 4),
        T.Q4_K: ("w4a16", 32, torch.float32, True, 128 + 8 * 8),
        T.Q5_K: ("w8a16", 32, torch.float32, True, 256 + 8 * 8),
        T.Q6_K: ("w8a16", 16, torch.float32, False, 256 + 16 * 4),
        T.MXFP4: ("w8a16", 32, torch.float32, False, 256 + 8 * 4),
    }
    assert set(expected) == set(TYPES)
    for qtype, (scheme, group, scale_dtype, has_offsets, nbytes) in expected.items():
        w = weight_from_gguf(_random_blocks(rng, qtype, n, k, False), qtype, (n, k))
        assert (w.scheme, w.group_size, w.scales.dtype, w.offsets is not None) == (scheme, group, scale_dtype,
                                                                                   has_offsets), qtype.name
        assert w.zeros is None and w.nbytes == n * nbytes, qtype.name
        assert row_bytes(qtype, k) <= nbytes


def test_refusals_name_what_was_wrong() -> None:
    raw = np.zeros((2, row_bytes(T.Q4_0, 64)), np.uint8)
    weight_from_gguf(raw, T.Q4_0, (2, 64))
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0"):
        weight_from_gguf(raw, T.IQ4_NL, (2, 64))
    with pytest.raises(ValueError, match="supported"):
        weight_from_gguf(raw, 9999, (2, 64))
    with pytest.raises(ValueError, match="is 144 bytes, the tensor holds 72"):
        weight_from_gguf(raw, T.Q4_0, (4, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        weight_from_gguf(raw, T.Q4_K, (2, 64))
    with pytest.raises(ValueError, match="uint8"):
        weight_from_gguf(raw.astype(np.int16), T.Q4_0, (2, 64))
    assert request_quant([T.F32, T.F16]) == "none"
    assert request_quant([T.F32, T.Q6_K]) == AFFINE_CAPABILITY


@pytest.fixture(params=["vnni", "avx2"])
def int4_body(request):
    """The int8-activation products' AVX-512 VNNI bodies, or their AVX2 ones (where the CPU has no VNNI both are AVX2)."""
    from flashllm.backends.cpu import native

    if native.library() is None:
        yield request.param
        return
    before = native.a8_vnni()
    native.a8_vnni(request.param == "vnni")
    yield request.param
    native.a8_vnni(before)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 40, 37])
def test_cpu_backend_quant_matmul_matches_the_reference(qtype: GGMLQuantizationType, tokens: int, int4_body) -> None:
    """The cpu backend's kernel (native where it builds) on real GGUF layouts, fp16 scales included,
    held to the reference on the inputs it says it rounds (int8 activations, as llama.cpp's)."""
    from flashllm.backends.cpu import native
    from flashllm.backends.cpu import quant as cpu_quant
    from flashllm.quant import gguf_activations

    rng = np.random.default_rng(7 + int(qtype))
    # 960 features: an odd number of 64-feature blocks, which the VNNI body leaves to the AVX2 one
    n, k = 72, 960 if tokens == 3 and GGML_QUANT_SIZES[qtype][0] == 32 else 1024
    weight = weight_from_gguf(_random_blocks(rng, qtype, n, k, extreme=False), qtype, (n, k))
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    inputs = cpu_quant.rounded_inputs({"x": x, "weight": weight, "bias": bias})
    xr, w = inputs["x"].double(), dequantize(weight).double()
    expected = xr @ w.T + bias.double()
    fmt = native.llama_format(weight)
    if fmt == "q8_1":  # llama.cpp's fp16 block sums meet the minimums: a term the rounded x cannot carry
        expected += gguf_activations.round_activations(x, fmt)[1] @ weight.offsets.double().T
    # fp32 sums of K / 16 partial sums (blocks, groups, offsets): about K / 16 ulps of the sum of
    # |terms|, which large K-quant minimums make far larger than the result itself
    bound = k / 16 * 2.0**-24 * (xr.abs() @ w.abs().T + bias.double().abs())
    got = cpu_quant.quant_matmul(x, weight, bias).double()
    assert bool(((got - expected).abs() <= bound).all()), float(((got - expected).abs() / bound).max())


def test_cpu_gguf_int8_codes_meet_int8_activations_as_in_llama_cpp(monkeypatch) -> None:
    """Q8_0 / Q5_0 (int8 codes, group 32, like flashllm's own w8a16 at group 32) run against int8
    activations by default because they came from a GGUF file; flashllm's own w8a16 stays exact."""
    from flashllm.backends.cpu import native
    from flashllm.quant import quantize_weight

    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    monkeypatch.delenv(native.W8_ACTIVATIONS_ENV, raising=False)
    rng = np.random.default_rng(3)
    for qtype in (T.Q8_0, T.Q5_0):
        weight = weight_from_gguf(_random_blocks(rng, qtype, 8, 256, extreme=False), qtype, (8, 256))
        assert weight.gguf_type == qtype.name and native.int8_activations(weight)
    own = quantize_weight(torch.randn(8, 256), "w8a16", 32)
    assert own.gguf_type is None and not native.int8_activations(own)
    monkeypatch.setenv(native.W8_ACTIVATIONS_ENV, "fp32")
    assert not native.int8_activations(weight)
