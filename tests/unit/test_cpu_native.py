"""The cpu backend's native decode kernels (csrc/decode_kernels.c) against float64 products and the reference.

Every product is held to the fp32 dot-product error bound |err| <= K * 2**-24 * (|x| @ |W|.T)
(Higham's gamma_K, with a slack factor for the scale multiply) against the same product in
float64, W being the dequantized weight, so a kernel that reads a wrong code, zero, scale or row
fails by far more than rounding.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.cpu import native
from flashllm.backends.cpu import quant as cpu_quant
from flashllm.ops.quant_matmul import QuantizedWeight, dequantize
from flashllm.ops.quant_matmul import quant_matmul as reference
from flashllm.quant import quantize_weight

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")


@pytest.fixture(autouse=True)
def exact_w8_tiles() -> Iterator[None]:
    """Per-channel w8a16 on the exact fp32 tiles at every size (test_cpu_w8_bf16.py tests the bf16 path)."""
    default = native.w8_bf16_min()
    native.w8_bf16_min(0)
    yield
    native.w8_bf16_min(default)


def assert_within_fp32_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                             magnitude: torch.Tensor | None = None) -> None:
    """got (T, N) fp32 against x (T, K) @ w (N, K).T in float64, within 2 * K * 2**-24 * |x| @ |m|.T,
    m the magnitudes the kernel's fp32 terms have (w itself unless given)."""
    exact = x.double() @ w.double().T
    m = w if magnitude is None else magnitude
    bound = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ m.double().abs().T) + 1e-30
    excess = (got.double() - exact).abs() - bound
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool((excess <= 0).all()), f"worst excess over the bound: {excess.max().item():.3g}"


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, native.MAX_TOKENS), k=st.integers(1, 300), n=st.integers(1, 70))
def test_f32_gemv_any_shape(tokens: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + n)
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(n, k, generator=gen)
    assert_within_fp32_bound(native.f32_linear(x, w), x, w)


def rows_at_once() -> list[int]:
    """The row counts the one-token fp32 loop can read at once on this CPU (8 needs AVX-512F)."""
    default = native.f32_rows()
    try:
        return [rows for rows in (2, 8) if native.f32_rows(rows) == rows]
    finally:
        native.f32_rows(default)


@pytest.fixture(params=[2, 8])
def f32_rows(request: pytest.FixtureRequest) -> Iterator[int]:
    """The fp32 products set to native.f32_rows(request.param) for one test: 2 the AVX2 paths, 8 the
    AVX-512 ones (skipped where the CPU lacks AVX-512F)."""
    if request.param not in rows_at_once():
        pytest.skip(f"reading {request.param} rows at once needs AVX-512F, which this CPU lacks")
    default = native.f32_rows()
    native.f32_rows(request.param)
    yield request.param
    native.f32_rows(default)


@pytest.mark.parametrize("tokens", [2, 3, 5, 7, 13, 16, native.MAX_TOKENS, 35, 100, 530])
@pytest.mark.parametrize("k", [264, 272])
def test_f32_tiles_cover_every_row_and_token(f32_rows: int, tokens: int, k: int) -> None:
    # K a multiple of 8 takes the AVX2 register tiles (4 rows x 3 tokens), and with the AVX-512 paths
    # on (f32_rows 8) K a multiple of 16 takes the 16-lane ones (4 rows x 6 tokens); 67 rows leave 3
    # for the one-row tiles, and token counts that are not multiples of 3 or 6 exercise uneven sweeps;
    # past 32 tokens the 16-lane tiles take them 32 at a time (35: a chunk of 3 after one of 32; 530:
    # a serving step's 512 prompt tokens and 18 decodes, 16 chunks and a tail)
    gen = torch.Generator().manual_seed(tokens + k)
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(67, k, generator=gen)
    assert_within_fp32_bound(native.f32_linear(x, w), x, w)


@pytest.mark.parametrize("k", [896, 2056])
def test_one_token_products_on_both_sides_of_the_long_row_switch(k: int) -> None:
    # one token: rows of up to 2048 features stream row by row, longer ones through the 4-row tiles
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(67, k, generator=gen)
    assert_within_fp32_bound(native.f32_linear(x, w), x, w)


def test_the_one_token_loop_reads_eight_rows_where_the_cpu_has_avx512f() -> None:
    from flashllm.backends.cpu import cpu_flags

    assert native.f32_rows() == (8 if "avx512f" in cpu_flags() else 2)
    assert native.f32_rows(3) == native.f32_rows()  # an unsupported count changes nothing


@pytest.fixture(params=[2, 8])
def gemv_rows(request: pytest.FixtureRequest) -> Iterator[int]:
    """The AVX-512 paths' one-token loop set to native.f32_gemv_rows(request.param) for one test."""
    default = native.f32_gemv_rows()
    assert native.f32_gemv_rows(request.param) == request.param
    yield request.param
    native.f32_gemv_rows(default)


@pytest.mark.parametrize("k", [32, 896, 2048, 4864])
@pytest.mark.parametrize("n", [1, 2, 7, 67, 130])
def test_one_token_rows_read_together_give_each_row_its_own_bits(f32_rows: int, gemv_rows: int, k: int,
                                                                 n: int) -> None:
    # one token, K a multiple of 32: the AVX2 paths run the stream tiles (4 rows a quarter of the share
    # apart), the AVX-512 paths read rows two (on AMD) or eight at a time (on Intel), the others from the
    # share's later halves or eighths, leftover rows alone (130 rows split over the pool's threads); each
    # row's sum must be the one it gets by itself
    gen = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    got = native.f32_linear(x, w)
    assert_within_fp32_bound(got, x, w)
    alone = torch.cat([native.f32_linear(x, w[i : i + 1]) for i in range(n)], dim=1)
    assert torch.equal(got, alone)


def test_the_avx512_one_token_loop_reads_two_rows_on_amd_and_eight_elsewhere() -> None:
    # csrc/decode_kernels.c: on Zen 4 the pair loop out-reads the eight-row one (docs/benchmarks.md)
    vendor = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo").read().splitlines()
                   if line.startswith("vendor_id")), "") if os.path.exists("/proc/cpuinfo") else ""
    assert native.f32_gemv_rows() == (2 if vendor == "AuthenticAMD" else 8)
    assert native.f32_gemv_rows(3) == native.f32_gemv_rows()  # an unsupported count changes nothing


@pytest.mark.parametrize("tokens", [2, 7, 16, 70])
@pytest.mark.parametrize("k", [272, 896])
@pytest.mark.parametrize("n", [5, 67, 130])
def test_tiled_rows_give_each_row_its_own_bits(f32_rows: int, tokens: int, k: int, n: int) -> None:
    # a few tokens: the AVX2 tiles take contiguous 4-row blocks, the 16-lane ones rows a quarter of
    # the share apart (n 5 and 67 leave a row, 130 two; 130 rows split over the pool's threads);
    # each row's and token's sum must be the one that row gets by itself
    gen = torch.Generator().manual_seed(k + n + tokens)
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(n, k, generator=gen)
    got = native.f32_linear(x, w)
    assert_within_fp32_bound(got, x, w)
    alone = torch.cat([native.f32_linear(x, w[i : i + 1]) for i in range(n)], dim=1)
    assert torch.equal(got, alone)


@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("k", [8, 264, 576, 1544])
@pytest.mark.parametrize("n", [5, 67, 130])
def test_stream_tiles_give_the_blocks_bits(tokens: int, k: int, n: int) -> None:
    # the AVX2 stream tiles (a verify step's 2 to 9 tokens) read rows a quarter of the share apart, the
    # features in 128-wide chunks (264 and 1544 end on a part chunk), with one accumulator per row and
    # token in the blocks' order: every output must equal the 4-row blocks' (stream tiles off) bit for bit
    if native.f32_rows() != 2:
        pytest.skip("the AVX2 stream tiles run only where the AVX2 fp32 paths do (no AVX-512F)")
    gen = torch.Generator().manual_seed(k + n + tokens)
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(n, k, generator=gen)
    default = native.f32_stream_max()
    try:
        assert native.f32_stream_max(9) == 9
        streamed = native.f32_linear(x, w)
        assert native.f32_stream_max(0) == 0
        blocks = native.f32_linear(x, w)
    finally:
        native.f32_stream_max(default)
    assert_within_fp32_bound(streamed, x, w)
    assert torch.equal(streamed, blocks)


@pytest.mark.parametrize("k", [8, 264, 576, 896, 1544, 4864])
@pytest.mark.parametrize("n", [5, 67, 130])
def test_a_token_gets_the_same_bits_alone_and_in_any_batch_on_the_avx2_paths(k: int, n: int) -> None:
    # the AVX2 fp32 products (f32_rows 2, on any x86-64 CPU): one token and up to 9 run the stream tiles,
    # more the 4-row blocks, every output one 8-lane accumulator in one order; so each token's row of a
    # batch's product must be the product of that token alone (a decode step alone, in a batch, beside
    # a verify step's rows). With one token off the stream tiles (f32_stream_min(2): the pair loop, or
    # the row loop where K is no multiple of 32) every K but 4864 (the blocks' at any count) fails.
    gen = torch.Generator().manual_seed(k * 7 + n)
    x, w = torch.randn(native.MAX_TOKENS, k, generator=gen), torch.randn(n, k, generator=gen)
    default = native.f32_rows()
    native.f32_rows(2)
    try:
        alone = torch.cat([native.f32_linear(x[t : t + 1], w) for t in range(native.MAX_TOKENS)])
        batches = {tokens: native.f32_linear(x[:tokens], w) for tokens in (2, 5, 9, 10, 16, native.MAX_TOKENS)}
    finally:
        native.f32_rows(default)
    assert_within_fp32_bound(alone, x, w)
    for tokens, batch in batches.items():
        assert torch.equal(batch, alone[:tokens]), f"{tokens} tokens"


def test_one_token_runs_the_stream_tiles_by_default() -> None:
    default = native.f32_stream_min()
    try:
        assert native.f32_stream_min(3) == default and native.f32_stream_min(0) == default  # unsupported
        assert native.f32_stream_min(2) == 2
    finally:
        native.f32_stream_min(default)
    assert default == 1


def test_the_stream_tiles_take_two_to_nine_tokens() -> None:
    default = native.f32_stream_max()
    try:
        assert native.f32_stream_max(10) == default and native.f32_stream_max(1) == default  # unsupported: unchanged
        assert native.f32_stream_max(5) == 5
    finally:
        native.f32_stream_max(default)
    assert default == 9


@pytest.fixture(params=["z", "avx2"])
def w8_tiles(request: pytest.FixtureRequest) -> Iterator[str]:
    """Per-channel int8 products of 2+ tokens on the AVX-512 16-lane tiles ("z"; skipped where the CPU
    lacks AVX-512F) or the AVX2 ones, for one test."""
    default = native.w8_z_min()
    if request.param == "z" and native.w8_z_min(2) != 2:
        pytest.skip("the 16-lane int8 tiles need AVX-512F, which this CPU lacks")
    native.w8_z_min(2 if request.param == "z" else 0)
    yield request.param
    native.w8_z_min(default)


@pytest.mark.parametrize("tokens", [2, 4, 7, 16, native.MAX_TOKENS, 33, 100])
@pytest.mark.parametrize("k,n", [(896, 67), (272, 130), (4864, 9)])
def test_per_channel_int8_tiles_give_each_row_and_token_its_own_bits(w8_tiles: str, tokens: int, k: int,
                                                                     n: int) -> None:
    # w8a16 per channel, 2+ tokens: 4-row tiles (rows a quarter of the share apart on the 16-lane
    # path; n 67 and 9 leave rows for the one-row tiles, 130 rows split over the pool's threads) swept
    # over the tokens 6 (16-lane, 32 tokens a chunk past 32) or 3 (AVX2) at a time. Against the
    # dequantized product in float64,
    # and each row and token must get the bits it gets alone: a tile reading another row's codes or
    # scale, another token's activations, or summing across sweeps fails one or the other
    gen = torch.Generator().manual_seed(k + n + tokens)
    weight = quantize_weight(torch.randn(n, k, generator=gen), "w8a16", -1, True)
    x = torch.randn(tokens, k, generator=gen)
    x[:, 5] *= 40
    got = native.int_linear(x, weight)
    assert_within_fp32_bound(got, x, dequantize(weight).float())
    rows = torch.cat([native.int_linear(x, _rows_of(weight, i)) for i in range(n)], dim=1)
    assert torch.equal(got, rows)
    if w8_tiles == "z":  # the same bits whatever the rest of the batch (two tokens: still the 16-lane tiles)
        pairs = torch.cat([native.int_linear(x[[t, (t + 1) % tokens]], weight)[:1] for t in range(tokens)])
        assert torch.equal(got, pairs)


def _rows_of(weight: QuantizedWeight, row: int) -> QuantizedWeight:
    """One output row of a per-channel int8 weight as its own weight."""
    return QuantizedWeight(weight.scheme, weight.data[row : row + 1].contiguous(),
                           weight.scales[row : row + 1].contiguous(), None, group_size=weight.group_size)


@pytest.mark.parametrize("runs", [1, 2, 33, 1000])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize(("streams", "step"), [(2, 64), (8, 32), (1, 32), (3, 64), (16, 32)])
def test_the_read_probe_reads_every_run_once(threads, runs: int, workers: int, streams: int, step: int) -> None:
    # the bandwidth probe's kernel (`streams` streams per thread, the runs left over after them read
    # alone) sums what torch sums
    threads(workers)
    gen = torch.Generator().manual_seed(runs)
    buf = torch.rand(runs * native.READ_RUN_FLOATS, generator=gen)
    assert native.read_stream(buf, streams, step) == pytest.approx(buf.double().sum().item(), rel=1e-5)
    assert native.read_stream(torch.ones_like(buf), streams, step) == buf.numel()  # ones add up exactly
    with pytest.raises(ValueError, match=f"whole {native.READ_RUN_FLOATS}-float runs"):
        native.read_stream(buf[:-1], streams, step)


@pytest.mark.parametrize(("streams", "step"), [(0, 32), (17, 32), (2, 16), (2, 48)])
def test_the_read_probe_refuses_patterns_it_cannot_read(streams: int, step: int) -> None:
    with pytest.raises(ValueError, match="1 to 16 streams"):
        native.read_stream(torch.ones(native.READ_RUN_FLOATS), streams, step)


def test_the_read_probe_calls_read_their_buffer() -> None:
    from flashllm.backends.cpu import read_probe

    reads = read_probe.stream_reads((3 << 20) + 100)  # rounded down to whole runs
    assert list(reads) == list(read_probe.PATTERNS)
    assert [read() for read in reads.values()] == [(3 << 20) // 4] * len(reads)


QUANT_CASES = [  # scheme, group size, symmetric
    ("w8a16", -1, True), ("w8a16", 32, True), ("w8a16", 128, True),
    ("w4a16", -1, True), ("w4a16", 32, True), ("w4a16", 64, False), ("w4a16", 128, False),
]


def check_integer_product(weight: QuantizedWeight, x: torch.Tensor) -> None:
    """int_linear against the dequantized product; for int4 x int8 activations, against the product
    of the activations as that kernel rounds them, its fp32 terms being scale x code and scale x zero."""
    got = native.int_linear(x, weight)
    w = dequantize(weight).float()
    if not native.int8_activations(weight):
        assert_within_fp32_bound(got, x, w)
        return
    scales = weight.scales.float().repeat_interleave(weight.in_features // weight.num_groups, dim=1)
    largest = 30 if weight.scheme == "w4a16" else 128  # int4 codes and zeros <= 15; int8 codes >= -128
    assert_within_fp32_bound(got, native.int8_rounded(x.double()), w, magnitude=largest * scales)


@pytest.fixture(params=["int8", "fp32"])
def int4_activations(request, monkeypatch) -> str:
    monkeypatch.setenv(native.INT4_ACTIVATIONS_ENV, request.param)
    return request.param


@pytest.fixture(params=["fp32", "int8"])
def w8_activations(request, monkeypatch) -> str:
    monkeypatch.setenv(native.W8_ACTIVATIONS_ENV, request.param)
    return request.param


@pytest.mark.parametrize("scheme,group_size,symmetric", QUANT_CASES)
@pytest.mark.parametrize("tokens", [1, 2, 5, native.MAX_TOKENS])
def test_integer_weight_gemv_matches_the_dequantized_product(scheme, group_size, symmetric, tokens,
                                                             int4_activations, w8_activations) -> None:
    gen = torch.Generator().manual_seed(tokens)
    weight = quantize_weight(torch.randn(77, 256, generator=gen), scheme, group_size, symmetric)
    x = torch.randn(tokens, 256, generator=gen)
    x[:, 3] *= 50  # an outlier channel, as real activations have
    assert native.supports_quantized(weight, tokens)
    chosen = int4_activations if scheme == "w4a16" else w8_activations
    assert native.int8_activations(weight) == (chosen == "int8")  # groups of 32: within a 64-feature block
    check_integer_product(weight, x)


@pytest.mark.parametrize("scheme,group_size,symmetric", [("w4a16", 64, False), ("w8a16", -1, True), ("w8a16", 128, True)])
def test_int8_activations_are_within_half_a_step_of_the_exact_product(scheme, group_size, symmetric,
                                                                      monkeypatch) -> None:
    # the one approximation of the integer x int8 paths, bounded: |got - x W^T| <= |W| (absmax / 254)
    # per block, plus fp32 rounding; a zero block must stay exact
    monkeypatch.setenv(native.W8_ACTIVATIONS_ENV, "int8")
    gen = torch.Generator().manual_seed(9)
    weight = quantize_weight(torch.randn(40, 384, generator=gen), scheme, group_size, symmetric)
    x = torch.randn(3, 384, generator=gen)
    x[1, 64:128] = 0.0
    assert native.int8_activations(weight)
    w = dequantize(weight).double()
    step = x.reshape(3, -1, native.A8_BLOCK).abs().amax(-1, keepdim=True).expand(-1, -1, native.A8_BLOCK)
    bound = (step.reshape(3, -1).double() / 254) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)
    error = (native.int_linear(x, weight).double() - x.double() @ w.T).abs()
    assert bool((error <= bound).all())
    assert error.max() > 0  # it is an approximation: an exact result would mean the fp32 kernel ran


@pytest.mark.parametrize("group_size,symmetric", [(64, True), (64, False), (128, True), (-1, True)])
def test_int4_tokens_of_a_pass_each_get_their_own_bits(group_size: int, symmetric: bool) -> None:
    # a draft pass brings 1 to ~10 tokens; the decode body shares each unpacked block among up to six of
    # them and takes rows in pairs for up to three: every row of every token must get the bits it gets
    # alone (another token's scales, sums or zero-point terms leaking in, or a pair's second row reading
    # the first's codes, changes them) and stay within the rounded activations' product
    gen = torch.Generator().manual_seed(group_size + symmetric)
    weight = quantize_weight(torch.randn(37, 768, generator=gen), "w4a16", group_size, symmetric)
    x = torch.randn(12, 768, generator=gen)
    x[:, 5] *= 40
    x[4, 64:128] = 0.0  # a zero block: scale 0, codes 0
    assert native.int8_activations(weight)
    alone = torch.cat([native.int_linear(x[t : t + 1], weight) for t in range(12)])
    for tokens in range(2, 13):
        assert torch.equal(native.int_linear(x[:tokens], weight), alone[:tokens]), tokens
    odd_rows = QuantizedWeight("w4a16", weight.data[1:], weight.scales[1:],
                               None if weight.zeros is None else weight.zeros[1:], weight.group_size)
    assert torch.equal(native.int_linear(x[:3], odd_rows), alone[:3, 1:])  # rows paired the other way
    check_integer_product(weight, x)


@pytest.mark.parametrize("in_features,symmetric", [(576, False), (576, True), (1536, False), (2112, False)])
def test_int4_scale_table_body_keeps_the_rows_bodys_bits(in_features: int, symmetric: bool) -> None:
    # passes of 4+ tokens with groups of 64 run table_row, which makes each row's scale x d products
    # 8 blocks at a time: 9, 24 and 33 blocks leave a part of 8 (its scales masked), and the products,
    # fmas and their order are flash_rows', so every token must get the same bits from both bodies,
    # in any pass (up to 10 tokens a sweep, 12 in two), 1-3 tokens (flash_rows alone) included
    gen = torch.Generator().manual_seed(in_features + symmetric)
    weight = quantize_weight(torch.randn(45, in_features, generator=gen), "w4a16", 64, symmetric)
    x = torch.randn(12, in_features, generator=gen)
    x[:, 7] *= 30
    x[3, 128:192] = 0.0  # a zero block: scale 0, codes 0
    before = native.a8_table()
    try:
        native.a8_table(False)
        rows = native.int_linear(x, weight)
        alone = torch.cat([native.int_linear(x[t : t + 1], weight) for t in range(12)])
        native.a8_table(True)
        assert native.a8_table()
        for tokens in range(2, 13):
            assert torch.equal(native.int_linear(x[:tokens], weight), rows[:tokens]), tokens
        assert torch.equal(rows, alone)
    finally:
        native.a8_table(before)
    check_integer_product(weight, x)


def test_asymmetric_zero_points_are_read_per_row_and_group(monkeypatch) -> None:
    # every group of every row gets its own zero point: a kernel using one zero everywhere fails
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (40, 64), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (40, 4), generator=gen, dtype=torch.uint8)
    scales = torch.rand(40, 4, generator=gen) + 0.5
    weight = QuantizedWeight("w4a16", codes, scales, zeros, group_size=32)
    x = torch.randn(3, 128, generator=gen)
    assert native.int8_activations(weight)  # groups of 32: two per activation block, one per 128-bit lane
    check_integer_product(weight, x)
    monkeypatch.setenv(native.INT4_ACTIVATIONS_ENV, "fp32")
    assert_within_fp32_bound(native.int_linear(x, weight), x, dequantize(weight).float())
    monkeypatch.delenv(native.INT4_ACTIVATIONS_ENV)
    wide = QuantizedWeight("w4a16", codes.reshape(20, 128), scales.reshape(20, 8)[:, ::2].contiguous(),
                           zeros.reshape(20, 8)[:, ::2].contiguous(), group_size=64)
    assert native.int8_activations(wide)  # the int4 x int8 kernel reads them the same way
    check_integer_product(wide, torch.randn(3, 256, generator=gen))


@pytest.mark.parametrize("tokens", [1, 2, 7])
@pytest.mark.parametrize("scheme", ["none", "w8a16", "w4a16"])
def test_row_split_over_threads_gives_the_single_thread_bits(threads, scheme: str, tokens: int,
                                                            int4_activations) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3000, 512, generator=gen)
    x = torch.randn(tokens, 512, generator=gen)
    weight = quantize_weight(w, scheme, 64) if scheme != "none" else None

    def run() -> torch.Tensor:
        return native.f32_linear(x, w) if weight is None else native.int_linear(x, weight)

    threads(1)
    single = run()
    threads(3)
    assert native.parallel.should_split(tokens, 3000, 512)
    got = run()
    assert torch.equal(got, single)  # each row is one thread's dot product, in the same order
    if weight is None:
        assert_within_fp32_bound(got, x, w)
    else:
        check_integer_product(weight, x)


def test_engine_paths_choose_the_native_kernels_for_decode_batches(monkeypatch) -> None:
    monkeypatch.delenv(native.PROMPT_ACTIVATIONS_ENV, raising=False)
    w8 = quantize_weight(torch.randn(64, 128), "w8a16")
    w4_group16 = quantize_weight(torch.randn(64, 128), "w4a16", 16)
    assert cpu_quant.choose_path(w8, 1, packed_fast=True) == "native"
    # a prompt of a per-channel int8 weight runs the 16-lane tiles where the CPU has AVX-512F (int_linear,
    # exact fp32 like dequantizing), else it dequantizes for a GEMM; grouped ones dequantize; either takes
    # the integer prompt kernels when told to (native.prompt_linear)
    prompt = "native" if native.w8_z_min() else "dequant"
    assert cpu_quant.choose_path(w8, native.MAX_TOKENS + 1, packed_fast=False) == prompt
    assert cpu_quant.choose_path(quantize_weight(torch.randn(64, 128), "w8a16", 32), 100, packed_fast=False) == "dequant"
    assert cpu_quant.choose_path(w4_group16, 1, packed_fast=False) == "dequant"  # groups of 16: not taken
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, "int8x2")
    assert cpu_quant.choose_path(w8, native.MAX_TOKENS + 1, packed_fast=False) == "native_prompt"
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    got = cpu_quant.run_path("native", x, w8, torch.ones(64))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference(x, w8, torch.ones(64)), atol=1e-2, rtol=1.6e-2)


def test_dense_decode_products_take_the_native_kernel(monkeypatch) -> None:
    calls = []
    real = native.f32_linear
    monkeypatch.setattr(native, "f32_linear", lambda x, w: calls.append(x.shape) or real(x, w))
    x, w = torch.randn(2, 64), torch.randn(48, 64)
    got = cpu_quant.dense_matmul(x, QuantizedWeight.dense(w), torch.ones(48))
    assert calls == [(2, 64)]
    assert_within_fp32_bound(got - 1, x, w)
    cpu_quant.dense_matmul(torch.randn(native.dense_max_tokens() + 1, 64), QuantizedWeight.dense(w))
    cpu_quant.dense_matmul(x.bfloat16(), QuantizedWeight.dense(w.bfloat16()))
    assert len(calls) == 1  # a long prompt and half precision stay on torch
    # prompts up to dense_max_tokens(): the 16-lane tiles where the CPU has AVX-512F, else torch
    cpu_quant.dense_matmul(torch.randn(native.MAX_TOKENS + 1, 64), QuantizedWeight.dense(w))
    assert len(calls) == (2 if native.f32_rows() == 8 else 1)


def test_switched_off_or_unbuildable_the_torch_paths_take_over(monkeypatch, tmp_path) -> None:
    try:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        native.reset()
        assert native.library() is None and native.ENV_SWITCH in native.unavailable_reason()
        weight = quantize_weight(torch.randn(64, 128), "w8a16")
        assert cpu_quant.choose_path(weight, 1, packed_fast=False) == "dequant"
        assert not native.supports_dense(torch.randn(1, 128), torch.randn(64, 128))

        monkeypatch.setenv(native.ENV_SWITCH, "1")
        monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CC", "false")                          # a "compiler" that always fails
        native.reset()
        assert native.library() is None
        assert "building the native kernels failed" in native.unavailable_reason()
        assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind
    finally:
        monkeypatch.undo()
        native.reset()
    assert native.library() is not None, os.environ.get(native.ENV_SWITCH)


def test_concurrent_callers_each_get_their_own_product(threads) -> None:
    # the worker pool takes one task at a time; a second caller runs its task on its own thread
    import concurrent.futures

    threads(2)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(2048, 512, generator=gen) for _ in range(4)]
    x = torch.randn(1, 512, generator=gen)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda w: [native.f32_linear(x, w) for _ in range(20)], weights))
    for w, outs in zip(weights, results, strict=True):
        for out in outs:
            assert_within_fp32_bound(out, x, w)


def test_a_forked_child_starts_its_own_workers(threads) -> None:
    import multiprocessing

    threads(2)
    w, x = torch.randn(2048, 512), torch.randn(1, 512)
    native.f32_linear(x, w)  # the parent's workers exist now
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:  # the child inherits the pool's state but none of its threads
        child = pool.apply_async(_child_product, (x, w)).get(timeout=60)
    assert_within_fp32_bound(child, x, w)


def _child_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(2)
    return native.f32_linear(x, w)


_IDLE_POOL = """
import time, torch
from flashllm.backends.cpu import native
torch.set_num_threads(2)
native.f32_linear(torch.randn(1, 512), torch.randn(2048, 512))  # the workers exist and ran a share
time.sleep(0.2)  # every worker has stopped spinning by now
before = time.process_time()  # the CPU time of every thread of the process
time.sleep(0.3)
print(time.process_time() - before)
"""


def test_idle_workers_sleep() -> None:
    # workers spin ~5 ms of pauses after a task (thread_pool.h), then sleep: an idle engine costs
    # no CPU (a worker spinning through the window would add ~0.3 s of CPU time). In a fresh
    # process, so no other test's threads count.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _IDLE_POOL], capture_output=True, text=True, timeout=120, check=True)
    assert float(run.stdout.split()[-1]) < 0.05
