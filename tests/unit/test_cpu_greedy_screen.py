"""The cpu backend's greedy LM head (greedy_screen.py): the fp32 argmax from a bf16 or int8 copy and a
bound. The int8 copy's own bound and kernels: test_cpu_greedy_screen_int8.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm import LLM, SamplingParams
from flashllm.backends.cpu import greedy_screen, native
from flashllm.models.weight_bytes import weight_bytes
from flashllm.testing.greedy_rows import greedy_screen_rows
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")


_AMX_ANY = 3  # csrc/greedy_screen.c's path that takes every token count through the AMX tiles


def _best_path() -> int:
    """The best path this CPU has (0 AVX2, 1 AVX-512, 2 AMX from 8 tokens), left set: a path the
    CPU lacks changes nothing, so 2 then 1 lands on the best whatever was set before."""
    lib = native.library()
    if lib is None:
        return 0
    return 2 if lib.flashllm_screen_set_path(2) == 2 else lib.flashllm_screen_set_path(1)


def _paths() -> list[int]:
    """The screen's kernel paths this CPU runs: 0 (AVX2); 1 (AVX-512) and, where it has AMX-BF16,
    the AMX tiles at every token count."""
    best = _best_path()
    return list(range(min(best, 1) + 1)) + ([_AMX_ANY] if best == 2 else [])


@pytest.fixture(params=_paths(), ids=lambda p: {0: "avx2", 1: "avx512", _AMX_ANY: "amx"}[p])
def path(request):
    lib = native.library()
    best = _best_path()
    lib.flashllm_screen_set_path(request.param)
    yield request.param
    lib.flashllm_screen_set_path(best)


def _copies() -> list[tuple[str, int]]:
    """(copy, kernel path) pairs this CPU runs: the bf16 copy on each of _paths(), and the int8 copy on
    each int8 path it has: the VNNI loops (1), the AMX-INT8 tiles at every token count (3), the AVX2
    loops (4; a path the CPU lacks leaves the setting as it was)."""
    lib = native.library()
    if lib is None:
        return [("bf16", p) for p in _paths()]
    best = lib.flashllm_i8_screen_set_path(-1)
    int8 = [p for p in (1, 3, 4) if best and lib.flashllm_i8_screen_set_path(p) == p]
    lib.flashllm_i8_screen_set_path(best)
    return [("bf16", p) for p in _paths()] + [("int8", p) for p in int8]


@pytest.fixture(params=_copies(), ids=lambda c: f"{c[0]}-{c[1]}")
def copy(request):
    """(kind, path): the copy the test's screens score from, with that kernel path set for it."""
    kind, path = request.param
    lib = native.library()
    if kind == "bf16":
        best = _best_path()
        lib.flashllm_screen_set_path(path)
        yield request.param
        lib.flashllm_screen_set_path(best)
    else:
        best = lib.flashllm_i8_screen_set_path(-1)
        lib.flashllm_i8_screen_set_path(path)
        yield request.param
        lib.flashllm_i8_screen_set_path(best)


def _scores(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, torch.Tensor]:
    """flashllm_bf16_gemv_mt's return value and scores for tokens x against the bf16 copy of weight."""
    tokens, k = x.shape
    copy = weight.to(torch.bfloat16).contiguous()
    scores = torch.empty(tokens, weight.shape[0])
    scratch = torch.empty(greedy_screen.scratch_floats(tokens, k))
    got = native.library().flashllm_bf16_gemv_mt(x.data_ptr(), copy.data_ptr(), scores.data_ptr(), tokens, k,
                                                 weight.shape[0], weight.shape[0], scratch.data_ptr(), 2)
    return got, scores


@pytest.mark.parametrize("tokens", [1, 3, 16, 21])
def test_scores_stay_within_their_bound(path, tokens) -> None:
    """Every score is within E * sum |x| |w| of the exact logit, E the bound of the kernel that took
    it. All-positive terms make the errors add up rather than cancel: tokens just under a bf16
    halfway point (truncated to bf16, each would lose 2^-7 of itself) against weights exact in
    bf16, and random ones against random weights."""
    if path == 0 and tokens > 9:
        pytest.skip("an AVX2 CPU's screen leaves more than 9 tokens to the fp32 tiles")
    gen = torch.Generator().manual_seed(tokens)
    k = 96
    weight = torch.rand(70, k, generator=gen).to(torch.bfloat16).float() + 0.5
    weight[35:] = torch.randn(35, k, generator=gen)
    x = torch.full((tokens, k), 1 + 2.0**-7 - 2.0**-20)
    x[(tokens + 1) // 2 :] = torch.randn(tokens // 2, k, generator=gen) * 4
    got, scores = _scores(x, weight)
    assert got == (2 if path == _AMX_ANY else 1)
    exact = x.double() @ weight.double().T
    bound = greedy_screen.error_factor(k, split=got == 2) * (x.double().abs() @ weight.double().abs().T)
    assert bool(((scores.double() - exact).abs() <= bound).all())


def test_the_amx_tiles_take_eight_tokens_and_more() -> None:
    if _best_path() != 2:
        pytest.skip("no AMX-BF16, or no permission from the kernel to use it")
    weight = torch.randn(40, 64)
    assert [_scores(torch.randn(t, 64), weight)[0] for t in (1, 7, 8, 32, 33)] == [1, 1, 2, 2, 1]


class _Fallback:
    """The full-logits argmax a screen falls back to, counting the rows it was asked for."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.rows = weight, 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.rows += rows.shape[0]
        return (rows @ self.weight.T).argmax(dim=-1)


def _screen(weight: torch.Tensor, kind: str = "bf16") -> tuple[greedy_screen.GreedyScreen, _Fallback]:
    fallback = _Fallback(weight)
    return greedy_screen.GreedyScreen(weight, weight.shape[0], fallback, kind), fallback


@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("vocab,features", [(4099, 96), (1000, 896)])
def test_random_heads_give_the_float64_argmax(copy, tokens, vocab, features) -> None:
    gen = torch.Generator().manual_seed(vocab + tokens)
    weight = torch.randn(vocab, features, generator=gen) * 0.05
    x = torch.randn(tokens, features, generator=gen) * 3
    screen, fallback = _screen(weight, copy[0])
    got = screen(x)
    if copy == ("bf16", 0) and tokens > 9:  # an AVX2 CPU's screen leaves more tokens to the fp32 tiles
        assert got is None
        return
    exact = x.double() @ weight.double().T
    top2 = exact.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] > 1e-3).all()), "the drawn logits are too close for this check"
    assert got.tolist() == exact.argmax(dim=-1).tolist()
    assert fallback.rows == 0 and tokens <= screen.picked <= 8 * tokens  # a few rows each, on random weights


@pytest.mark.parametrize("tokens", [2, 3, 5, 9, 10])
def test_the_avx2_tiles_take_a_verify_steps_rows(tokens) -> None:
    """On the AVX2 path the tiles take 2 to 9 tokens (a speculative verify step's 1 + k rows, k <= 8)
    and give the float64 argmax (10 tokens go to the fp32 head); switched off, the rows take at most 2,
    with the same tokens. 1,001 rows leave the tiles' last rows to the one-row sweeps."""
    lib = native.library()
    best, default = _best_path(), lib.flashllm_screen_set_avx2_tiles(-1)
    gen = torch.Generator().manual_seed(tokens)
    weight = torch.randn(1001, 96, generator=gen) * 0.05
    x = torch.randn(tokens, 96, generator=gen) * 3
    screen, fallback = _screen(weight)
    try:
        lib.flashllm_screen_set_path(0)
        assert lib.flashllm_screen_set_avx2_tiles(9) == 9 and lib.flashllm_screen_set_avx2_tiles(10) == 9
        got = screen(x)
        if tokens > 9:
            assert got is None
            return
        exact = x.double() @ weight.double().T
        assert got is not None and got.tolist() == exact.argmax(dim=-1).tolist() and fallback.rows == 0
        assert lib.flashllm_screen_set_avx2_tiles(0) == 0
        rows = screen(x)
        assert rows is None if tokens > 2 else rows.tolist() == got.tolist()
    finally:
        lib.flashllm_screen_set_path(best)
        lib.flashllm_screen_set_avx2_tiles(default)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_pick_splits_a_few_tokens_rows_over_the_threads(copy, threads, monkeypatch) -> None:
    """With fewer tokens than threads, the pick's two passes run each token's rows in parts (one a
    thread, starting on multiples of 8); the vocabulary, 1,001 rows, leaves a tail in the last part.
    Every split gives the float64 argmax, and a tie across parts still goes to the first row."""
    from flashllm.backends.cpu import parallel

    monkeypatch.setattr(parallel, "workers", lambda: threads)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(1001, 64, generator=gen) * 0.05
    x = torch.randn(3, 64, generator=gen) * 3
    best = x[0] / x[0].norm()
    weight[900], weight[7], weight[1000] = best, best, x[2] / x[2].norm()  # rows 7 and 900 tie for token 0
    screen, fallback = _screen(weight, copy[0])
    for tokens in (1, 2, 3):
        got = screen(x[:tokens])
        exact = x[:tokens].double() @ weight.double().T
        assert got.tolist() == exact.argmax(dim=-1).tolist()
        assert got.tolist()[0] == 7 and fallback.rows == 0
    assert screen.picked <= 8 * 6  # each part's floor counts: a few rows a token, as with one part
    assert (x[2] @ weight.T).argmax() == 1000  # the tail row: the last part's scalar loop picks it


def test_a_row_its_bf16_copy_ranks_second_is_settled_in_fp32(path) -> None:
    """Row 20 has the larger fp32 logit, but every weight of it rounds down in bf16 by nearly the
    most rounding can (2^-8), so its score sits 0.24 below row 10's exact one. The margins (~0.25
    each) keep row 20 among the rows recomputed in fp32; a quarter of them would not."""
    features = 64
    x = torch.ones(1, features)
    weight = -torch.rand(64, features, generator=torch.Generator().manual_seed(0)) * 0.1  # far below
    weight[20] = 1 + 2.0**-8 - 2.0**-20  # just under halfway between the bf16 values 1 and 1 + 2^-7
    weight[10] = 1.0
    weight[10, :31] = 1 + 2.0**-7  # exact in bf16
    assert torch.equal(weight[20].to(torch.bfloat16).float(), torch.ones(features))
    exact = (x.double() @ weight.double().T)[0]
    assert int(exact.argmax()) == 20 and exact[20] - exact[10] > 5e-3
    scores = x @ weight.to(torch.bfloat16).float().T
    assert float(scores[0, 10] - scores[0, 20]) == pytest.approx(31 * 2.0**-7)
    screen, _ = _screen(weight)
    assert screen(x).tolist() == [20]
    assert screen.picked == 2


def test_tied_rows_give_the_first(copy) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 32, generator=gen) * 0.01
    x = torch.randn(2, 32, generator=gen)
    best = torch.randn(32, generator=gen)
    weight[31], weight[7] = best, best  # the same row twice: the same fp32 logit
    screen, _ = _screen(weight, copy[0])
    assert screen(x * 0 + best).tolist() == [7, 7]


def test_a_token_without_finite_scores_takes_its_full_logits(copy) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 32, generator=gen)
    x = torch.randn(2, 32, generator=gen)
    x[1, 3] = float("nan")
    screen, fallback = _screen(weight, copy[0])
    got = screen(x)
    assert fallback.rows == 1
    assert got.tolist() == [int((x[0] @ weight.T).argmax()), 0]  # NaN logits: torch's argmax takes the first


def test_a_row_with_a_nan_weight_wins_as_in_torch(copy) -> None:
    """A score that is not finite sends the token to its full logits, where torch's argmax takes
    the NaN; skipping the row instead would pick the best finite one."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 32, generator=gen)
    weight[123, 5] = float("nan")
    x = torch.randn(1, 32, generator=gen)
    screen, fallback = _screen(weight, copy[0])
    assert screen(x).tolist() == [123]
    assert fallback.rows == 1


def test_a_row_whose_sum_overflows_to_nan_wins_as_in_torch(copy) -> None:
    """Finite weights whose products overflow both ways (+inf and -inf in different lanes): that
    score is NaN while every margin stays finite, and torch's argmax of the full logits takes it."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 32, generator=gen)
    x = torch.zeros(1, 32)
    x[0, :2] = 1e20
    weight[7, :2] = torch.tensor([1e20, -1e20])
    screen, fallback = _screen(weight, copy[0])
    assert screen(x).tolist() == [7]
    assert fallback.rows == 1


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    prompts = ["hello world", "the cat sat on", "a", "one two three four five six seven"]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["qwen2", "llama"], ids=["tied", "untied"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("greedy-screen"), request.param, seed=5)


def test_the_engine_takes_greedy_steps_through_the_screen(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64, "max_model_len": 256,
              "max_num_seqs": greedy_screen_rows()}  # batches the screen takes
    llm = LLM(str(model_dir), **kwargs)
    model = llm.engine.parts.model
    screen = greedy_screen.kept(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = _generate(llm, greedy)
    assert screen.picked >= 4 * 24
    # sampling, or greedy with logprobs, needs the logits: the screen stays out of those steps
    picked = screen.picked
    sampled = _generate(llm, SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True))
    logprobs = _generate(llm, SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True))
    assert screen.picked == picked
    # the copy is counted, and read by a greedy step in place of the float head
    counted = weight_bytes(model)
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "0")
    plain = LLM(str(model_dir), **kwargs)
    assert greedy_screen.kept(plain.engine.parts.model) is None
    assert _generate(plain, greedy) == tokens
    assert _generate(plain, SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)) == sampled
    assert [t[:8] for t in tokens] == logprobs
    plain_counted = weight_bytes(plain.engine.parts.model)
    head = model.lm_head.weight
    assert counted.total == plain_counted.total + screen.nbytes
    # the copy, its fp32 row bounds, and the int8 copy's fp32 scales
    per_row = {"bf16": (2, 4), "int8": (1, 8)}[screen.kind]
    assert screen.nbytes == head.numel() * per_row[0] + head.shape[0] * per_row[1]
    assert counted.streamed == plain_counted.streamed - head.numel() * 4 + screen.nbytes


def test_the_amx_tiles_give_the_engine_the_same_tokens(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every greedy step scored on the AMX tiles (path 3 takes any token count): the tokens of the
    full fp32 logits, as with the screen off."""
    if _best_path() != 2:
        pytest.skip("no AMX-BF16, or no permission from the kernel to use it")
    kwargs = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64, "max_model_len": 256,
              "max_num_seqs": greedy_screen_rows()}  # batches the screen takes
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lib = native.library()
    lib.flashllm_screen_set_path(_AMX_ANY)
    try:
        llm = LLM(str(model_dir), **kwargs)
        tokens = _generate(llm, greedy)
        assert greedy_screen.kept(llm.engine.parts.model).picked >= 4 * 24
    finally:
        lib.flashllm_screen_set_path(2)
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "0")
    assert _generate(LLM(str(model_dir), **kwargs), greedy) == tokens
