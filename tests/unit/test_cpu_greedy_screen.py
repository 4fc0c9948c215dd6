"""The cpu backend's greedy LM head (greedy_screen.py): the fp32 argmax from a bf16 copy and a bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm import LLM, SamplingParams
from flashllm.backends.cpu import greedy_screen, native
from flashllm.quant import weight_bytes
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")


def _paths() -> list[int]:
    """The screen's kernel paths this CPU runs: 0 (AVX2), and 1 (AVX-512) where it has it."""
    lib = native.library()
    best = lib.flashllm_screen_set_path(1) if lib is not None else 0
    return list(range(best + 1))


@pytest.fixture(params=_paths(), ids=lambda p: ("avx2", "avx512")[p])
def path(request):
    lib = native.library()
    best = lib.flashllm_screen_set_path(1)
    lib.flashllm_screen_set_path(request.param)
    yield request.param
    lib.flashllm_screen_set_path(best)


class _Fallback:
    """The full-logits argmax a screen falls back to, counting the rows it was asked for."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.rows = weight, 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.rows += rows.shape[0]
        return (rows @ self.weight.T).argmax(dim=-1)


def _screen(weight: torch.Tensor) -> tuple[greedy_screen.GreedyScreen, _Fallback]:
    fallback = _Fallback(weight)
    return greedy_screen.GreedyScreen(weight, weight.shape[0], fallback), fallback


@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("vocab,features", [(4099, 96), (1000, 896)])
def test_random_heads_give_the_float64_argmax(path, tokens, vocab, features) -> None:
    gen = torch.Generator().manual_seed(vocab + tokens)
    weight = torch.randn(vocab, features, generator=gen) * 0.05
    x = torch.randn(tokens, features, generator=gen) * 3
    screen, fallback = _screen(weight)
    got = screen(x)
    if path == 0 and tokens > 2:  # an AVX2 CPU's screen leaves more tokens to the fp32 tiles
        assert got is None
        return
    exact = x.double() @ weight.double().T
    top2 = exact.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] > 1e-3).all()), "the drawn logits are too close for this check"
    assert got.tolist() == exact.argmax(dim=-1).tolist()
    assert fallback.rows == 0 and tokens <= screen.picked <= 8 * tokens  # a few rows each, on random weights


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


def test_tied_rows_give_the_first(path) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 32, generator=gen) * 0.01
    x = torch.randn(2, 32, generator=gen)
    best = torch.randn(32, generator=gen)
    weight[31], weight[7] = best, best  # the same row twice: the same fp32 logit
    screen, _ = _screen(weight)
    assert screen(x * 0 + best).tolist() == [7, 7]


def test_a_token_without_finite_scores_takes_its_full_logits(path) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 32, generator=gen)
    x = torch.randn(2, 32, generator=gen)
    x[1, 3] = float("nan")
    screen, fallback = _screen(weight)
    got = screen(x)
    assert fallback.rows == 1
    assert got.tolist() == [int((x[0] @ weight.T).argmax()), 0]  # NaN logits: torch's argmax takes the first


def test_a_row_with_a_nan_weight_wins_as_in_torch(path) -> None:
    """A score that is not finite sends the token to its full logits, where torch's argmax takes
    the NaN; skipping the row instead would pick the best finite one."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 32, generator=gen)
    weight[123, 5] = float("nan")
    x = torch.randn(1, 32, generator=gen)
    screen, fallback = _screen(weight)
    assert screen(x).tolist() == [123]
    assert fallback.rows == 1


def test_a_row_whose_sum_overflows_to_nan_wins_as_in_torch(path) -> None:
    """Finite weights whose products overflow both ways (+inf and -inf in different lanes): that
    score is NaN while every margin stays finite, and torch's argmax of the full logits takes it."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 32, generator=gen)
    x = torch.zeros(1, 32)
    x[0, :2] = 1e20
    weight[7, :2] = torch.tensor([1e20, -1e20])
    screen, fallback = _screen(weight)
    assert screen(x).tolist() == [7]
    assert fallback.rows == 1


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    prompts = ["hello world", "the cat sat on", "a", "one two three four five six seven"]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["qwen2", "llama"], ids=["tied", "untied"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("greedy-screen"), request.param, seed=5)


def test_the_engine_takes_greedy_steps_through_the_screen(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = {"device": "cpu", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64, "max_model_len": 256}
    llm = LLM(str(model_dir), **kwargs)
    model = llm.engine.parts.model
    screen = model.lm_head.greedy_screen
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = _generate(llm, greedy)
    assert screen.picked >= 4 * 24
    # sampling, or greedy with logprobs, needs the logits: the screen stays out of those steps
    picked = screen.picked
    sampled = _generate(llm, SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True))
    logprobs = _generate(llm, SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True))
    assert screen.picked == picked
    # the bf16 copy is counted, and read by a greedy step in place of the float head
    counted = weight_bytes(model)
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "0")
    plain = LLM(str(model_dir), **kwargs)
    assert getattr(plain.engine.parts.model.lm_head, "greedy_screen", None) is None
    assert _generate(plain, greedy) == tokens
    assert _generate(plain, SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)) == sampled
    assert [t[:8] for t in tokens] == logprobs
    plain_counted = weight_bytes(plain.engine.parts.model)
    head = model.lm_head.weight
    assert counted.total == plain_counted.total + screen.nbytes
    assert screen.nbytes == head.numel() * 2 + head.shape[0] * 4
    assert counted.streamed == plain_counted.streamed - head.numel() * 4 + screen.nbytes
