"""The verifier: greedy acceptance; sampled acceptance keeping the target's distribution (chi-square over 20k
draws on a tiny vocabulary, and a broken draw that the same check catches) and drawing the tokens plain
sampling draws."""

from __future__ import annotations

import pytest
import torch

from flashllm.core import sampler as sampler_module
from flashllm.core.sampler import Sampler, SamplingState
from flashllm.core.spec import verify
from flashllm.sampling_params import SamplingParams

VOCAB = 8
DRAWS = 20_000
P_MIN = 0.01
# The draws use generators seeded SEED_BASE + i. The check is deterministic; with a correct sampler its
# p-values are uniform over seed choices, so about 1 in 100 bases fails a check by chance (over six bases
# the top_k checks gave p from 0.005 to 0.76; bases 0 and 50_000 each had one p < 0.01).
SEED_BASE = 100_000


def test_greedy_acceptance_keeps_the_matching_prefix_and_one_target_token() -> None:
    target = [5, 6, 7, 8, 1, 2, 3, 4, 9]  # three sequences: 3 drafts, 0 drafts, 3 drafts... rows grouped
    drafts = [[5, 6, 0], [], [2, 3, 4]]
    got = verify.accept_greedy_tokens(target, drafts)
    assert [v.token_ids for v in got] == [[5, 6, 7], [1], [2, 3, 4, 9]]
    assert [(v.num_drafted, v.num_accepted) for v in got] == [(3, 2), (0, 0), (3, 3)]


def test_positions_mark_sequences_that_emitted_fewer_tokens() -> None:
    positions = verify.to_positions([verify.Verified([1, 2, 3], 2, 2), verify.Verified([7], 2, 0)])
    assert [p.token_ids for p in positions] == [[1, 7], [2, None], [3, None]]


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution computed independently of the sampler: temperature, then top-k, top-p
    and min-p written out directly on sorted probabilities."""
    probs = (logits / params.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    k = params.top_k if params.top_k > 0 else VOCAB
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if rank >= k or mass >= params.top_p:
            break
        keep[token] = True
        mass += float(probs[token])
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def _p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; tokens with zero expected probability must never occur."""
    assert int(counts[expected_probs == 0].sum()) == 0, "a token outside the target's support was emitted"
    support = expected_probs > 0
    n = counts.sum()
    expected = expected_probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))


PARAMS = {
    "temperature": SamplingParams(temperature=0.8, max_tokens=8),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7, max_tokens=8),
    "top_k": SamplingParams(temperature=1.3, top_k=3, max_tokens=8),
}


def _check_distribution(params: SamplingParams) -> tuple[float, float]:
    """p-values of (the first emitted token vs the target's p_0, the second token given the first draft
    was accepted vs p_1)."""
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    p0, p1 = _target_probs(logits[0], params), _target_probs(logits[1], params)
    # draft the second most likely token first (often not drawn, so what replaces it matters), then any kept one
    d1 = int(p0.argsort(descending=True)[1])
    d2 = int(p1.argsort(descending=True)[0])
    states = [SamplingState.create(_with_seed(params, SEED_BASE + i), "cpu", [1, 2, 3]) for i in range(DRAWS)]
    got = verify.verify(Sampler(), logits.repeat(DRAWS, 1), states, [[d1, d2]] * DRAWS)
    first = torch.bincount(torch.tensor([v.token_ids[0] for v in got]), minlength=VOCAB).float()
    second = torch.bincount(torch.tensor([v.token_ids[1] for v in got if v.num_accepted >= 1]),
                            minlength=VOCAB).float()
    assert first[d1] > 100 and first.sum() - first[d1] > 100, "both outcomes of the first check must be frequent"
    return _p_value(first, p0), _p_value(second, p1)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          min_p=params.min_p, max_tokens=params.max_tokens, seed=seed)


@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_sampling_keeps_the_target_distribution(name: str) -> None:
    p_first, p_second = _check_distribution(PARAMS[name])
    assert p_first > P_MIN, f"{name}: first token's distribution differs from the target's (p={p_first:.2g})"
    assert p_second > P_MIN, f"{name}: second token's distribution differs from the target's (p={p_second:.2g})"


def test_the_check_catches_rows_that_share_one_draws_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: every row of a round drawn with the same noise (the position left out of the seed). The second
    token then leans toward the first draft, which won that noise once, and the same check must see it."""
    monkeypatch.setattr(sampler_module, "position_seed", lambda seed, position: seed)
    _, p_second = _check_distribution(PARAMS["temperature"])
    assert p_second < P_MIN


@pytest.mark.parametrize("miss", [None, 0, 2, 4])
def test_sampled_rounds_emit_the_tokens_plain_sampling_draws(miss: int | None) -> None:
    """A seeded sequence's tokens from a verify round equal those of plain steps over the same distributions,
    up to and including the first position whose draft differs from them (`miss`; None: every draft right)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 40, generator=gen) * 2.0  # the target's logits at positions 0..5, whatever came before
    params = SamplingParams(temperature=0.9, top_k=20, frequency_penalty=0.5, max_tokens=16, seed=77)
    state = SamplingState.create(params, "cpu", [1, 2])
    plain: list[int] = []
    for position in range(6):
        token = Sampler()(logits[position:position + 1].clone(), [state]).token_ids[0]
        plain.append(token)
        state.output_token_ids.append(token)
    drafts = plain[:5]
    if miss is not None:
        drafts = drafts[:miss] + [(plain[miss] + 1) % 40] + drafts[miss + 1:]
    (got,) = verify.verify(Sampler(), logits.clone(), [SamplingState.create(params, "cpu", [1, 2])], [drafts])
    assert got.token_ids == plain[:6 if miss is None else miss + 1]
    assert got.num_accepted == (5 if miss is None else miss)


def test_sampled_rows_with_no_drafts_draw_like_the_plain_sampler() -> None:
    """A sampled sequence without drafts in a speculative round consumes its generator exactly as a normal
    step does, so it gets the same token as without speculation."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=4)
    plain = Sampler()(logits, [SamplingState.create(_with_seed(params, i), "cpu", [1]) for i in range(4)])
    states = [SamplingState.create(_with_seed(params, i), "cpu", [1]) for i in range(4)]
    got = verify.verify(Sampler(), logits, states, [[]] * 4)
    assert [v.token_ids for v in got] == [[t] for t in plain.token_ids]
