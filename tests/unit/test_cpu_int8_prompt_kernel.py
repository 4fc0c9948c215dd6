"""The cpu backend's prompt products (native.prompt_linear: integer weights x int8 activation terms) within their bounds.

Two bounds per product, each against x @ W.T in float64 with W the dequantized weight:
- the rounding: |got - x W^T| <= (absmax_block / R) @ |W|^T + fp32 slack, R = 254 for one int8 term
  (half a step of absmax / 127) and 64516 for two (half a step of the remainder, itself at most half a
  step): an oracle from the blocks' largest |x| alone, not from the code's own rounding;
- the arithmetic: on the rounded activations (native.int8_rounded) the kernel is an fp32 dot product,
  within 2 K 2^-24 of |x| |W| (Higham's gamma_K with slack), so a wrong code, scale, offset, zero point,
  row or token fails by far more than rounding.
"""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu import native
from flashllm.backends.cpu import quant as cpu_quant
from flashllm.ops.quant_matmul import QuantizedWeight, dequantize
from flashllm.quant import quantize_weight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
K = 384  # six 64-feature blocks: three VNNI pairs


def _gguf_like(scheme: str, group: int, gen: torch.Generator, n: int = 72) -> QuantizedWeight:
    """GGUF's affine layouts (Q4_1 / Q8_0-with-minimum-like): codes, per-group scales and offsets."""
    if scheme == "w4a16":
        data = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, generator=gen)
    else:
        data = torch.randint(-128, 128, (n, K), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, K // group, generator=gen) / 50
    offsets = -torch.rand(n, K // group, generator=gen) / 10
    return QuantizedWeight(scheme, data, scales, group_size=group, offsets=offsets,
                           gguf_type="Q4_1" if scheme == "w4a16" else "Q8_0")


CASES = ["w8a16/-1", "w8a16/128", "w4a16/64", "w4a16/64/asym", "gguf-w4a16/32", "gguf-w8a16/32", "gguf-w8a16/16"]


def _weight(case: str, gen: torch.Generator) -> QuantizedWeight:
    parts = case.split("/")
    if parts[0].startswith("gguf-"):
        return _gguf_like(parts[0].removeprefix("gguf-"), int(parts[1]), gen)
    return quantize_weight(torch.randn(72, K, generator=gen), parts[0], int(parts[1]), len(parts) < 3)


@pytest.fixture(params=["vnni", "vnni-one-row", "avx2"])
def body(request):
    """The integer bodies: VNNI with int8 codes' prompts in 4-row tiles (where the CPU has VNNI), VNNI one
    row at a time, AVX2."""
    before, tiles = native.a8_vnni(), native.w8_tiles()
    native.a8_vnni(request.param != "avx2")
    native.w8_tiles(request.param == "vnni")
    yield request.param
    native.a8_vnni(before)
    native.w8_tiles(tiles)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens", [native.MAX_TOKENS + 1, 37, 130])
@pytest.mark.parametrize("mode,ratio", [("int8x2", 64516.0), ("int8", 254.0)])
def test_prompt_products_are_within_the_rounding_and_fp32_bounds(case, tokens, mode, ratio, body, monkeypatch):
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, mode)
    gen = torch.Generator().manual_seed(tokens)
    weight = _weight(case, gen)
    x = torch.randn(tokens, K, generator=gen)
    x[:, 3] *= 60      # an outlier channel, as real activations have
    x[5, 64:128] = 0.0  # a zero block stays exact
    assert cpu_quant.choose_path(weight, tokens, cpu_quant.PACKED_FAST) == "native_prompt"
    bias = torch.randn(weight.out_features, generator=gen)
    got = cpu_quant.quant_matmul(x, weight, bias).double() - bias.double()
    w = dequantize(weight).double()
    exact = x.double() @ w.T
    slack = 2 * K * 2.0**-24 * (x.double().abs() @ w.abs().T + bias.double().abs())
    step = x.reshape(tokens, -1, native.A8_BLOCK).abs().amax(-1, keepdim=True).expand(-1, -1, native.A8_BLOCK)
    bound = (step.reshape(tokens, K).double() / ratio) @ w.abs().T + slack
    error = (got - exact).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    assert error.max() > 0  # an approximation: an exact result would mean another path ran
    rounded = native.int8_rounded(x, 2 if mode == "int8x2" else 1).double()
    assert bool(((got - rounded @ w.T).abs() <= slack + 2 * K * 2.0**-24 * (rounded.abs() @ w.abs().T)).all())


@pytest.mark.skipif(not native.a8_vnni(), reason="the CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("afmt", [None, "llama"])
@pytest.mark.parametrize("case", ["w8a16/-1", "gguf-w8a16/32", "gguf-w8a16/16"])
def test_prompt_tiles_give_the_one_row_bits(case, afmt, monkeypatch):
    """The 4-row tiles sum each row as the one-row body does (which the bounds above hold to float64):
    70 rows (a remainder of 2 for the one-row body), 37 tokens (a tile of one), one and two terms, 1 and 3
    threads, flashllm's rounding and llama.cpp's."""
    gen = torch.Generator().manual_seed(9)
    parts = case.split("/")
    weight = (_gguf_like("w8a16", int(parts[1]), gen, n=70) if parts[0].startswith("gguf-")
              else quantize_weight(torch.randn(70, K, generator=gen), "w8a16", -1, True))
    x = torch.randn(37, K, generator=gen)
    x[:, 3] *= 60
    if afmt:
        monkeypatch.setenv(native.GGUF_ACTIVATIONS_ENV, afmt)
    tiles = native.w8_tiles()
    try:
        for mode in ("int8", "int8x2") if not afmt else ("int8",):
            monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, mode)
            for workers in (1, 3):
                monkeypatch.setattr(native.parallel, "workers", lambda w=workers: w)
                native.w8_tiles(False)
                one_row = native.prompt_linear(x, weight)
                native.w8_tiles(True)
                assert torch.equal(native.prompt_linear(x, weight), one_row), (mode, workers)
    finally:
        native.w8_tiles(tiles)


def test_two_terms_carry_each_block_to_its_bound():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(50, K, generator=gen) * torch.logspace(-3, 3, K)  # blocks from tiny to huge values
    step = x.reshape(50, -1, native.A8_BLOCK).abs().amax(-1, keepdim=True).double()
    # beyond the rounding bound, the fp32 remainder and the fp32 result each round by up to half an ulp of the
    # block's largest value (seen up to a quarter of 2**-24 x step over 200 seeds; a relative 1e-5 slack was short)
    fp32 = step * 2.0**-23
    for terms, ratio in ((1, 254.0), (2, 64516.0)):
        error = (native.int8_rounded(x, terms).double() - x.double()).reshape(50, -1, native.A8_BLOCK).abs()
        assert bool((error <= step / ratio + fp32).all()), terms
        assert bool((error > step / ratio / 8).any())  # and no finer than that: the bound is tight


def test_prompts_split_over_threads_give_the_single_thread_bits(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    weight = quantize_weight(torch.randn(1024, K, generator=gen), "w8a16", -1, True)
    x = torch.randn(70, K, generator=gen)
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, "int8x2")
    monkeypatch.setattr(native.parallel, "workers", lambda: 1)
    one = native.prompt_linear(x, weight)
    monkeypatch.setattr(native.parallel, "workers", lambda: 3)
    assert torch.equal(native.prompt_linear(x, weight), one)


def test_fp32_mode_and_decode_batches_keep_their_paths(monkeypatch):
    weight = quantize_weight(torch.randn(72, K), "w8a16", -1, True)
    monkeypatch.delenv(native.PROMPT_ACTIVATIONS_ENV, raising=False)
    # the default: exact, and faster today (per channel on AVX-512F: the 16-lane fp32-activation tiles)
    exact = "native" if native.w8_z_min() else "dequant"
    assert cpu_quant.choose_path(weight, 100, cpu_quant.PACKED_FAST) == exact
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, "fp32")
    assert cpu_quant.choose_path(weight, 100, cpu_quant.PACKED_FAST) == exact
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, "int8x2")
    assert cpu_quant.choose_path(weight, native.MAX_TOKENS, cpu_quant.PACKED_FAST) == "native"
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, "fp32")
    with pytest.raises(ValueError, match="supports_prompt"):
        native.prompt_linear(torch.randn(40, K), weight)
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, "int16")
    with pytest.raises(ValueError, match="FLASHLLM_CPU_PROMPT_ACTIVATIONS"):
        native.prompt_terms(weight)
