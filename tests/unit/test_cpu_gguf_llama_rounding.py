"""GGUF weights on the cpu backend meet activations rounded as llama.cpp's CPU backend rounds them
(q8_0 / q8_1 per 32 features with fp16 scales, q8_K per 256), in decode (native kernels, AVX2 and
VNNI bodies) and prompts (rounded x, fp32 GEMM), within fp32 rounding of the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from flashllm.backends.cpu import native  # noqa: E402
from flashllm.backends.cpu import quant as cpu_quant  # noqa: E402
from flashllm.ops.quant_matmul import dequantize  # noqa: E402
from flashllm.quant import gguf_activations as ga  # noqa: E402
from flashllm.quant.gguf_blocks import SUPPORTED_TYPES, weight_from_gguf  # noqa: E402

T = GGMLQuantizationType
TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,), T.MXFP4: ()}


def _blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    """(n, row bytes): random codes and sub-block scales, moderate fp16 fields of either sign."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    for start in HALF_FIELDS[qtype]:
        halves = (rng.uniform(0.5, 1.5, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0]) / 16).astype(np.float16)
        raw[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # its e8m0 exponent: scales 2^-9 .. 2^-5 around codes of up to 6
        raw[:, 0] = rng.integers(118, 123, raw.shape[0])
    return raw.reshape(n, -1)


def _activations(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Activations with blocks of very different sizes (a zero block, outliers, tiny values), as
    hidden states have: one scale per 64 features instead of 32 (or per 32 instead of 256) moves
    the result far outside the bound."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * torch.exp(2 * torch.randn(tokens, k // 32, 1, generator=g)).expand(
        tokens, k // 32, 32).reshape(tokens, k)
    x[:, 32:64] = 0.0
    x[:, 5] = 40.0
    x[:, 70:96] *= 1e-3
    return x


def _scalar_round(x: np.ndarray, fmt: str) -> np.ndarray:
    """round_activations' x, one block at a time in numpy float32 scalars (llama.cpp's formulas
    written out again: quantize_row_q8_0 / q8_1's AVX2 path, quantize_row_q8_K_ref)."""
    block = ga.BLOCK[fmt]
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for b in range(0, x.shape[1], block):
            v = x[t, b:b + block].astype(np.float32)
            if fmt == "q8_K":
                big = v[np.argmax(np.abs(v))]
                if big == 0:
                    continue
                iscale = np.float32(-127.0) / big
                codes = np.minimum(127, np.rint(iscale * v))
                out[t, b:b + block] = codes.astype(np.float64) * float(np.float32(1.0) / iscale)
            else:
                amax = np.abs(v).max()
                inverse = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
                codes = np.rint(v * inverse)
                out[t, b:b + block] = codes.astype(np.float64) * float(np.float16(amax / np.float32(127.0)))
    return out


@pytest.mark.parametrize("fmt", sorted(ga.BLOCK))
def test_round_activations_equals_llama_cpp_formulas_written_out_per_block(fmt: str) -> None:
    x = _activations(3, 512, 1)
    x[1, 256:512] = -x[1, 256:512].abs()  # q8_K's scale takes the sign of the block's largest |x|
    got, correction = ga.round_activations(x, fmt)
    np.testing.assert_array_equal(got.double().numpy(), _scalar_round(x.numpy(), fmt))
    assert (correction is None) == (fmt != "q8_1")


def _bound(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None, k: int) -> torch.Tensor:
    """fp32 sums of K / 16 partial sums: about K / 16 ulps of the sum of |terms|."""
    rounded_abs = x.abs().double() * 1.01
    terms = rounded_abs @ w.abs().double().T
    if offsets is not None:
        terms += (rounded_abs.reshape(x.shape[0], -1, 32).sum(-1)) @ offsets.abs().double().T
    return k / 16 * 2.0**-24 * terms + 1e-30


@pytest.fixture(params=[True, False], ids=["vnni", "avx2"])
def body(request, monkeypatch):
    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    monkeypatch.setenv(native.GGUF_ACTIVATIONS_ENV, "llama")
    monkeypatch.delenv(native.W8_ACTIVATIONS_ENV, raising=False)
    monkeypatch.delenv(native.INT4_ACTIVATIONS_ENV, raising=False)
    monkeypatch.delenv(native.PROMPT_ACTIVATIONS_ENV, raising=False)
    if request.param and not native.a8_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI")
    before = native.a8_vnni()
    native.a8_vnni(request.param)
    yield request.param
    native.a8_vnni(before)


@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["decode1", "decode3", "prompt40"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_products_round_activations_as_llama_cpp(qtype: GGMLQuantizationType, tokens: int, body) -> None:
    if tokens > native.MAX_TOKENS and not body:
        pytest.skip("prompts round in torch and multiply in BLAS: no native body to vary")
    rng = np.random.default_rng(11 + int(qtype))
    n, k = 24, 512
    weight = weight_from_gguf(_blocks(rng, qtype, n, k), qtype, (n, k))
    fmt = native.llama_format(weight)
    assert fmt == ga.FORMAT_OF_TYPE[qtype.name]
    x = _activations(tokens, k, tokens)
    w = dequantize(weight)
    minimums = weight.offsets if fmt == "q8_1" else None
    expected = ga.product(x, w, fmt, minimums)
    path = cpu_quant.choose_path(weight, tokens, cpu_quant.PACKED_FAST)
    assert path == ("native" if tokens <= native.MAX_TOKENS else "dequant")
    got = cpu_quant.quant_matmul(x, weight).double()
    bound = _bound(ga.round_activations(x, fmt)[0], w, minimums, k)
    assert bool(((got - expected).abs() <= bound).all()), float(((got - expected).abs() / bound).max())
    # the same bound fails flashllm's own 64-feature rounding, and exact activations: the test sees the format
    for other in (native.int8_rounded(x, 1).double() @ w.double().T, x.double() @ w.double().T):
        assert not bool(((other - expected).abs() <= bound).all())


def test_block64_is_the_default_and_keeps_flashllm_rounding(monkeypatch) -> None:
    if native.library() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    monkeypatch.delenv(native.GGUF_ACTIVATIONS_ENV, raising=False)  # the default
    rng = np.random.default_rng(5)
    weight = weight_from_gguf(_blocks(rng, T.Q4_1, 16, 256), T.Q4_1, (16, 256))
    assert native.llama_format(weight) is None and native.int8_activations(weight)
    x = _activations(2, 256, 3)
    expected = native.int8_rounded(x, 1).double() @ dequantize(weight).double().T
    got = cpu_quant.quant_matmul(x, weight).double()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv(native.GGUF_ACTIVATIONS_ENV, "exact")
    with pytest.raises(ValueError, match="block64, llama"):
        native.llama_format(weight)


def test_mixed_formats_are_refused() -> None:
    assert ga.format_of("Q5_0+Q8_0") == "q8_0" and ga.format_of(None) is None
    with pytest.raises(ValueError, match="do not share"):
        ga.format_of("Q4_0+Q4_1")


def _llama_cpp_cpu_library():
    """llama.cpp's own libggml-cpu next to $FLASHLLM_LLAMA_SERVER (the baselines' binary), or None."""
    import ctypes
    import os
    from pathlib import Path

    server = os.environ.get("FLASHLLM_LLAMA_SERVER")
    path = Path(server).parent / "libggml-cpu.so" if server else None
    if path is None or not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_get_type_traits_cpu.restype = ctypes.c_void_p
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    lib.ggml_cpu_init()
    return lib


def _llama_cpp_dot(lib, qtype: GGMLQuantizationType, row: np.ndarray, x: np.ndarray) -> float:
    """llama.cpp's product of one stored row with x: its from_float rounding of x to the type's vec_dot_type
    blocks, then its vec_dot (ggml-cpu.h's ggml_type_traits_cpu: from_float, vec_dot, vec_dot_type, nrows)."""
    import ctypes

    class Traits(ctypes.Structure):
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    from_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    vec_dot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    traits = Traits.from_address(lib.ggml_get_type_traits_cpu(int(qtype)))
    activation = GGMLQuantizationType(traits.vec_dot_type)
    block, size = GGML_QUANT_SIZES[activation]
    k = x.shape[0]
    rounded = np.zeros(k // block * size, np.uint8)
    x = np.ascontiguousarray(x, np.float32)
    from_float(Traits.from_address(lib.ggml_get_type_traits_cpu(int(activation))).from_float)(
        x.ctypes.data, rounded.ctypes.data, k)
    out, row = np.zeros(1, np.float32), np.ascontiguousarray(row)
    vec_dot(traits.vec_dot)(k, out.ctypes.data, 0, row.ctypes.data, 0, rounded.ctypes.data, 0, 1)
    return float(out[0])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_equal_llama_cpp_own_library(qtype: GGMLQuantizationType, body) -> None:
    """The independent oracle: llama.cpp's libggml-cpu (where $FLASHLLM_LLAMA_SERVER points at a build)
    rounds x and multiplies each stored row; flashllm's llama mode gives the same within fp32 rounding."""
    lib = _llama_cpp_cpu_library()
    if lib is None:
        pytest.skip("llama.cpp's libggml-cpu.so next to $FLASHLLM_LLAMA_SERVER (the baselines sessions set it)")
    rng = np.random.default_rng(23 + int(qtype))
    n, k = 16, 512
    raw = _blocks(rng, qtype, n, k)
    weight = weight_from_gguf(raw, qtype, (n, k))
    x = _activations(1, k, 9)
    theirs = torch.tensor([_llama_cpp_dot(lib, qtype, raw[i], x[0].numpy()) for i in range(n)], dtype=torch.float64)
    got = cpu_quant.quant_matmul(x, weight).double()[0]
    fmt = native.llama_format(weight)
    bound = _bound(ga.round_activations(x, fmt)[0], dequantize(weight), weight.offsets if fmt == "q8_1" else None, k)[0]
    assert bool(((got - theirs).abs() <= 2 * bound).all()), float(((got - theirs).abs() / bound).max())
