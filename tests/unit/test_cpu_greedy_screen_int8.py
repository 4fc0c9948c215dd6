"""The greedy screen's int8 copy (csrc/greedy_screen_int8.c and its bound in greedy_screen.py): scores
within the bound on inputs that make its errors add up, the same scores on the VNNI and AMX-INT8
paths, no int32 overflow at the largest K a multiplier allows, and the engine's greedy tokens.
The screen's behaviour on both copies (argmax, ties, NaN): test_cpu_greedy_screen.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flashllm import LLM, SamplingParams
from flashllm.backends.cpu import greedy_screen, native
from flashllm.testing.tiny_models import build_tiny_model

_LIB = native.library()
_BEST = _LIB.flashllm_i8_screen_set_path(-1) if _LIB is not None else 0
pytestmark = pytest.mark.skipif(_BEST == 0, reason="no native kernels, or no AVX2 for the int8 copy")
# csrc/greedy_screen_int8.c's paths: the VNNI loops, the AMX-INT8 tiles at every token count, the AVX2 loops
_VNNI, _AMX_ANY, _AVX2 = 1, 3, 4
_RETURNS = {_VNNI: 1, _AMX_ANY: 2, _AVX2: 4}  # what flashllm_i8_screen_mt returns on each
_NAMES = {_VNNI: "vnni", _AMX_ANY: "amx", _AVX2: "avx2"}


def _paths() -> list[int]:
    """The int8 paths this CPU runs: VNNI where it has AVX-512 VNNI, the AMX-INT8 tiles where it has
    those too, and the AVX2 loops on any of them (a path the CPU lacks leaves the setting as it was)."""
    if _BEST == 0:
        return []
    ran = [p for p in (_VNNI, _AMX_ANY, _AVX2) if _LIB.flashllm_i8_screen_set_path(p) == p]
    _LIB.flashllm_i8_screen_set_path(_BEST)
    return ran


def test_the_best_int8_path_is_avx2_exactly_where_the_cpu_lacks_avx512_vnni() -> None:
    vnni = all(torch.backends.cpu.get_cpu_capability() != "AVX2" and _cpu_has(flag)
               for flag in ("avx512f", "avx512bw", "avx512_vnni"))
    assert _BEST in ((1, 2) if vnni else (_AVX2,))


def _cpu_has(flag: str) -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and flag in cpuinfo.read_text().split()


@pytest.fixture(params=_paths(), ids=lambda p: _NAMES[p])
def path(request):
    _LIB.flashllm_i8_screen_set_path(request.param)
    yield request.param
    _LIB.flashllm_i8_screen_set_path(_BEST)


def _screen(weight: torch.Tensor) -> greedy_screen.GreedyScreen:
    return greedy_screen.GreedyScreen(weight, weight.shape[0], lambda rows: (rows @ weight.T).argmax(-1), "int8")


def _scores(screen: greedy_screen.GreedyScreen, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    scores = torch.empty(x.shape[0], screen.vocab_size)
    return screen._scores(_LIB, x.contiguous(), scores), scores


def _error_over_bound(screen: greedy_screen.GreedyScreen, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """|score - exact logit| over the pick's margin 1.01 ||x|| b_n + d (greedy_screen.py)."""
    exact = x.double() @ screen.weight.double().T
    k, norms = x.shape[1], x.double().norm(dim=1, keepdim=True)
    floor = 2 * (4 * k + math.sqrt(k) * (norms + screen.max_row_norm)) * 2.0**-125
    margin = 1.01 * norms * screen.row_bound.double()[None, :] + floor
    return (scores.double() - exact).abs() / margin


def test_the_multiplier_keeps_every_int32_sum_exact() -> None:
    assert [greedy_screen.int8_multiplier(k) for k in (32, 896, 1036, 1037, 4096, 132_000, 133_000)] == [
        128, 128, 128, 64, 32, 1, 0]


@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 21])
def test_weight_rounding_errors_that_add_up_stay_within_the_bound(path, tokens) -> None:
    """Every weight but a row's largest sits 0.499 of a step above its code (rounded down), and the
    tokens are exact in the token grid: the score falls short of the logit by nearly ||e_n|| ||x||."""
    k = 128
    weight = torch.full((40, k), 2.0**-7 * (5 + 0.5 - 2.0**-10))
    weight[:, 0] = 127 * 2.0**-7  # the scale: 2^-7
    weight[20:] = torch.randn(20, k, generator=torch.Generator().manual_seed(tokens))
    screen = _screen(weight)
    x = torch.ones(tokens, k)  # 64 t with t = 2^-6: no rounding
    ratio = _error_over_bound(screen, x, _scores(screen, x)[1])
    assert float(ratio.max()) <= 1.0
    assert float(ratio[:, :20].min()) > 0.95  # the bound is nearly reached: nothing of it can go


@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 21])
def test_token_rounding_errors_that_add_up_stay_within_the_bound(path, tokens) -> None:
    """Weights exact in the int8 grid, one feature of each token setting its step t and every other
    a quarter of t (32 steps t / m of the second part) and 0.499 of a step t / m more (rounded down):
    the score falls short of the logit by about half the token term ||s_n q_n|| r ||x||."""
    k, m = 128, greedy_screen.int8_multiplier(128)
    weight = torch.full((40, k), 2.0**-7 * 100)
    weight[:, 0] = 127 * 2.0**-7
    screen = _screen(weight)
    x = torch.full((tokens, k), 0.25 + (0.5 - 2.0**-10) / m)
    x[:, 0] = 127 * (1 - 2.0**-20)  # t = 1
    ratio = _error_over_bound(screen, x, _scores(screen, x)[1])
    assert float(ratio.max()) <= 1.0
    assert float(ratio.min()) > 0.45  # 1 / 2 of a bound that takes ||rho|| <= sqrt(K) t / (2m)


def test_random_scores_stay_within_the_bound(path) -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(500, 896, generator=gen) * 0.05
    weight[3] *= 1e-36  # a subnormal scale, and a token whose scores underflow
    screen = _screen(weight)
    x = torch.randn(21, 896, generator=gen) * 3
    x[5] *= 1e-20
    got, scores = _scores(screen, x)
    assert got == _RETURNS[path]
    ratio = _error_over_bound(screen, x, scores)
    assert float(ratio.max()) <= 1.0


def test_every_path_gives_the_same_scores() -> None:
    if len(_paths()) < 2:
        pytest.skip("one int8 path on this CPU (its scores are checked against the formula below)")
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(1000, 192, generator=gen)
    screen = _screen(weight)
    for tokens in (1, 8, 16, 17, 32):
        x = torch.randn(tokens, 192, generator=gen) * 10
        got = {}
        for path in _paths():
            _LIB.flashllm_i8_screen_set_path(path)
            got[path] = _scores(screen, x)
        _LIB.flashllm_i8_screen_set_path(_BEST)
        assert {path: ran for path, (ran, _) in got.items()} == {path: _RETURNS[path] for path in got}
        first = next(iter(got.values()))[1]
        assert all(torch.equal(first, scores) for _, scores in got.values())


def test_the_amx_tiles_take_six_tokens_and_more() -> None:
    if _BEST != 2:
        pytest.skip("no AMX-INT8, or no permission from the kernel to use it")
    screen = _screen(torch.randn(40, 128))
    assert [_scores(screen, torch.randn(t, 128))[0] for t in (1, 5, 6, 32)] == [1, 1, 2, 2]
    odd = _screen(torch.randn(40, 96))  # 96 features: not whole 64-code tiles
    assert _scores(odd, torch.randn(16, 96))[0] == 1


def test_the_largest_sums_do_not_overflow(path) -> None:
    """K = 4096 takes m = 32; every code at 127 and every token feature just under 127 t makes
    each sum ~2^31 (with m = 64 it would wrap around)."""
    k = 4096
    weight = torch.ones(64, k)
    weight[1::2] = -1.0
    screen = _screen(weight)
    assert screen.multiplier == 32
    x = torch.full((2, k), 127 * (1 - 2.0**-12))
    got, scores = _scores(screen, x)
    assert got == _RETURNS[path]
    exact = x.double() @ weight.double().T
    assert math.isclose(float(exact[0, 0]), k * 127 * (1 - 2.0**-12))
    assert float(_error_over_bound(screen, x, scores).max()) <= 1.0


def _formula_scores(screen: greedy_screen.GreedyScreen, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 copy's scores as the top of csrc/greedy_screen_int8.c states them, computed apart from
    the kernels: each token as integers P = m p1 + p2 in float64, I = sum q P in int64 (no int32 to
    overflow), then fl(fl(fl(I) s_n) (t / m)) in fp32; the scores and the sums I."""
    m = screen.multiplier
    tokens = []
    steps = []
    for row in x.double():
        _, e = math.frexp(float(row.abs().max()) / 127)  # t = 2^e > max |x| / 127
        t = 2.0**e if float(row.abs().max()) > 0 else 1.0
        v = row / t
        p1 = torch.round(v)  # to nearest even, as nearbyint
        tokens.append((p1 * m + torch.round((v - p1) * m)).long())
        steps.append(t / m)
    sums = torch.stack(tokens) @ screen.screen.long().T  # (T, N) int64, exact
    return sums.float() * screen.scales[None, :] * torch.tensor(steps, dtype=torch.float32)[:, None], sums


def _stressing_tokens(tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Tokens whose sums reach for 2^31: every feature just under 127 t (P near 127 m) in the first,
    its negative in the second, random signs (2% negative) in every other even token and random
    features in the odd ones from the third on."""
    x = torch.randn(tokens, k, generator=gen) * 5
    x[::2] = 127 * (1 - 2.0**-12) * torch.where(torch.rand(k, generator=gen) < 0.02, -1.0, 1.0)
    x[0] = 127 * (1 - 2.0**-12)
    x[1] = -x[0]
    return x


@pytest.mark.parametrize("k", [32, 96, 576, 1024, 1056, 2048, 4096, 132_608])
def test_scores_are_the_formula_bit_for_bit(path, k) -> None:
    """Every path's scores equal the formula's for 1 to 33 tokens, with features up to the largest
    each multiplier allows (1024 for m = 128, 2048 for 64, 132,608 for 1: sums of up to
    127 * 127 m K, within 2% of 2^31) and rows of codes +-127 that add every term with one sign."""
    gen = torch.Generator().manual_seed(k)
    rows = 1003 if k <= 4096 else 37  # odd: the last rows take the one-row sweeps
    weight = torch.randn(rows, k, generator=gen)
    weight[0], weight[1] = 1.0, -1.0  # codes all 127 / -127
    weight[2, ::2], weight[2, 1::2] = 1.0, -1.0
    screen = _screen(weight)
    assert screen.multiplier == greedy_screen.int8_multiplier(k) > 0
    x = _stressing_tokens(33, k, gen)
    want, sums = _formula_scores(screen, x)
    assert 0.97 * 127 * 127 * screen.multiplier * k < int(sums.abs().max()) < 2**31
    for tokens in range(1, 34) if k <= 4096 else (1, 2, 5, 9, 33):
        got, scores = _scores(screen, x[:tokens])
        assert got == _RETURNS[path]
        assert torch.equal(scores, want[:tokens]), f"{tokens} tokens"


@pytest.mark.parametrize("k", [96, 576, 1024])
def test_the_screen_gives_the_float64_argmax_at_every_token_count(path, k) -> None:
    """1 to 32 tokens (a decode batch up to native.MAX_TOKENS) through the screen and the pick give
    the argmax of the exact logits; 33 is more than a screen call takes."""
    gen = torch.Generator().manual_seed(k + 1)
    weight = torch.randn(2001, k, generator=gen) * 0.05
    screen = _screen(weight)
    x = torch.randn(native.MAX_TOKENS + 1, k, generator=gen) * 3
    exact = x.double() @ weight.double().T
    top2 = exact.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] > 1e-4).all()), "the drawn logits are too close for this check"
    for tokens in range(1, native.MAX_TOKENS + 1):
        assert screen(x[:tokens]).tolist() == exact[:tokens].argmax(dim=-1).tolist(), f"{tokens} tokens"
    assert screen(x) is None


def test_larger_features_than_any_multiplier_fits_keep_the_bf16_copy() -> None:
    weight = torch.zeros(4, 133_024)
    assert greedy_screen.GreedyScreen(weight, 4, lambda rows: rows).kind == "bf16"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("greedy-screen-int8"), "qwen2", seed=6)


def test_the_engine_takes_the_int8_copy_with_the_tokens_of_the_full_logits(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default screen on this CPU is the int8 copy, on every path its tokens are those of the
    bf16 copy and of the screen switched off, and FLASHLLM_CPU_GREEDY_SCREEN=bf16 keeps the bf16 copy."""
    kwargs = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64, "max_model_len": 256}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["hello world", "the cat sat on", "a", "one two three four five six seven"]

    def tokens(llm: LLM) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]

    llm = LLM(str(model_dir), **kwargs)
    screen = greedy_screen.kept(llm.engine.parts.model)
    assert screen.kind == "int8"
    got = {}
    for path in _paths():
        _LIB.flashllm_i8_screen_set_path(path)
        try:
            got[path] = tokens(llm)
        finally:
            _LIB.flashllm_i8_screen_set_path(_BEST)
    assert screen.picked >= 4 * 24 * len(got)
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "bf16")
    bf16 = LLM(str(model_dir), **kwargs)
    assert greedy_screen.kept(bf16.engine.parts.model).kind == "bf16"
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "0")
    plain = tokens(LLM(str(model_dir), **kwargs))
    assert all(t == plain for t in got.values())
    assert tokens(bf16) == plain
