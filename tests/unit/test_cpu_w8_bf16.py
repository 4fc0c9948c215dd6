"""Per-channel w8a16 products on bf16-rounded activations (csrc/w8_bf16.c) against a float64 oracle, and the switch.

The oracle: the activations rounded to bf16 by torch (round to nearest even), times the int8 codes, in
float64, times each row's scale. The kernel's products of a bf16 value and a code are exact in fp32, so
what is left is the fp32 sums' order: |err| <= 2 * K * 2**-24 * (|bf16(x)| @ |W|.T).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from flashllm.backends.cpu import cpu_flags, native
from flashllm.ops.quant_matmul import dequantize
from flashllm.quant import quantize_weight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")


@pytest.fixture
def bf16_path() -> Iterator[int]:
    """The bf16 path at its default threshold (skipped where the CPU lacks AVX512-BF16), restored after."""
    default = native.w8_bf16_min()
    if default == 0 and native.w8_bf16_min(16) == 0:
        pytest.skip("the bf16 w8a16 tiles need AVX512-BF16, which this CPU lacks")
    yield native.w8_bf16_min()
    native.w8_bf16_min(default)


@pytest.fixture
def exact_path() -> Iterator[None]:
    """The bf16 path off (the exact fp32 tiles), restored after."""
    default = native.w8_bf16_min()
    native.w8_bf16_min(0)
    yield
    native.w8_bf16_min(default)


def _excess(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far got (T, N) lies outside the fp32 bound around x (T, K) @ w (N, K).T in float64 (<= 0: inside)."""
    exact = x.double() @ w.double().T
    bound = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    return (got.double() - exact).abs() - bound


def _case(tokens: int, k: int, n: int) -> tuple[torch.Tensor, object]:
    gen = torch.Generator().manual_seed(7 * tokens + k + n)
    weight = quantize_weight(torch.randn(n, k, generator=gen), "w8a16", -1, True)
    x = torch.randn(tokens, k, generator=gen)
    x[:, 3] *= 60  # an outlier channel, as real activations have
    return x, weight


def test_the_path_follows_the_cpu_flags() -> None:
    # AVX2-only and AVX-512-without-BF16 hosts keep the exact tiles: the setter cannot turn it on there
    default = native.w8_bf16_min()
    try:
        assert (default > 0) == ("avx512_bf16" in cpu_flags())
        assert (native.w8_bf16_min(16) == 16) == ("avx512_bf16" in cpu_flags())
    finally:
        native.w8_bf16_min(default)


@pytest.mark.parametrize("tokens", [16, 33, 70, 200])
@pytest.mark.parametrize("k,n", [(896, 67), (4864, 9), (32, 130), (48, 1), (100, 37)])
def test_bf16_tiles_match_the_bf16_oracle(bf16_path: int, tokens: int, k: int, n: int) -> None:
    # 67 and 9 rows leave rows for the one-row tiles, 130 split over the pool's threads; 70 and 200
    # tokens cross the 64-token chunks and leave short sweeps; K 48 and 100 end in a partial 32-feature
    # block (a tensor-parallel rank's slice), which must read no feature past K
    x, weight = _case(tokens, k, n)
    w = dequantize(weight).float()
    got = native.int_linear(x, weight)
    rounded = x.bfloat16().float()
    assert bool((_excess(got, rounded, w) <= 0).all()), f"worst excess {_excess(got, rounded, w).max().item():.3g}"
    # the path really rounds: bf16's 8 significant bits put it ~2**15 times further from the unrounded
    # product than from the rounded one (fp32 sums of the unrounded activations would be as close to both)
    off_exact = (got.double() - x.double() @ w.double().T).abs().max()
    off_rounded = (got.double() - rounded.double() @ w.double().T).abs().max()
    assert off_exact > 100 * off_rounded


@pytest.mark.parametrize("tokens", [16, 45])
def test_a_tokens_bits_do_not_depend_on_the_batch_or_the_split(bf16_path: int, tokens: int, threads) -> None:
    x, weight = _case(tokens, 896, 200)
    got = native.int_linear(x, weight)
    padded = native.int_linear(torch.cat([x, x[:7]]), weight)[:tokens]  # other tokens, other chunks and sweeps
    assert torch.equal(got, padded)
    threads(1)
    assert torch.equal(native.int_linear(x, weight), got)


def test_below_the_threshold_and_switched_off_the_exact_tiles_run(bf16_path: int) -> None:
    x, weight = _case(bf16_path, 896, 67)
    w = dequantize(weight).float()
    assert bool((_excess(native.int_linear(x[:-1], weight), x[:-1], w) <= 0).all())  # one token short: exact
    native.w8_bf16_min(0)
    assert bool((_excess(native.int_linear(x, weight), x, w) <= 0).all())


def test_grouped_weights_keep_the_exact_tiles(bf16_path: int) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = quantize_weight(torch.randn(40, 256, generator=gen), "w8a16", 128, True)
    x = torch.randn(32, 256, generator=gen)
    assert bool((_excess(native.int_linear(x, weight), x, dequantize(weight).float()) <= 0).all())


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_environment_switch(monkeypatch) -> None:
    monkeypatch.setenv(native.W8_BF16_ENV, "0")
    native.reset()
    try:
        assert native.w8_bf16_min() == 0
        monkeypatch.setenv(native.W8_BF16_ENV, "yes")
        native.reset()
        with pytest.raises(ValueError, match=native.W8_BF16_ENV):
            native.library()
    finally:
        monkeypatch.delenv(native.W8_BF16_ENV)
        native.reset()
    assert (native.w8_bf16_min() > 0) == ("avx512_bf16" in cpu_flags())
