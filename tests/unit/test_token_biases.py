"""logit_bias (OpenAI) and allowed_token_ids (vLLM): validation, and what the sampler makes of them, checked
against the distributions they define."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flashllm.core.sampler import Sampler, SamplingState, plain_greedy
from flashllm.sampling_params import SamplingParams

sampler = Sampler()


def _state(**params: object) -> SamplingState:
    return SamplingState.create(SamplingParams(**params), "cpu", [1, 2, 3])


def _logits(seed: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("seed", range(5))
def test_a_bias_moves_the_greedy_choice_as_the_biased_logits_say(seed: int) -> None:
    logits = _logits(seed)
    top = int(logits.argmax())
    bias = {top: -100.0, 7: 2.5, 11: -1.0}
    expected = logits.clone()
    for token, value in bias.items():
        expected[0, token] += value
    out = sampler(logits, [_state(temperature=0.0, logit_bias=bias, logprobs=2)])
    assert out.token_ids == [int(expected.argmax())] and out.token_ids != [top]
    assert out.logprobs[0] == pytest.approx(float(expected.log_softmax(-1)[0, out.token_ids[0]]), abs=1e-5)


def test_plus_100_forces_a_token_and_minus_100_bans_one_when_sampling() -> None:
    logits = _logits(3)
    forced = [sampler(logits, [_state(temperature=1.0, seed=s, logit_bias={42: 100.0})]).token_ids[0]
              for s in range(50)]
    assert set(forced) == {42}
    top = int(logits.argmax())
    banned = [sampler(logits, [_state(temperature=1.0, seed=s, logit_bias={top: -100.0})]).token_ids[0]
              for s in range(300)]
    assert top not in banned
    free = [sampler(logits, [_state(temperature=1.0, seed=s)]).token_ids[0] for s in range(300)]
    assert top in free  # the ban is what keeps it out


def test_allowed_token_ids_sample_in_proportion_within_the_allowed_set() -> None:
    logits = torch.full((1, 40), 5.0)
    logits[0, [3, 9, 20]] = torch.tensor([0.0, 1.0, 2.0])  # the allowed tokens are the unlikely ones
    draws = Counter(sampler(logits, [_state(temperature=1.0, seed=s, allowed_token_ids=[3, 9, 20])]).token_ids[0]
                    for s in range(3000))
    assert set(draws) == {3, 9, 20}
    probs = torch.tensor([0.0, 1.0, 2.0]).softmax(-1)
    for token, p in zip((3, 9, 20), probs.tolist(), strict=True):
        assert abs(draws[token] / 3000 - p) < 0.04
    greedy = sampler(logits, [_state(temperature=0.0, allowed_token_ids=[3, 9])]).token_ids
    assert greedy == [9]


def test_bias_and_allow_list_together_and_rows_keep_their_own() -> None:
    logits = torch.cat([_logits(1), _logits(1)])
    states = [_state(temperature=0.0, allowed_token_ids=[5, 6], logit_bias={5: 100.0}), _state(temperature=0.0)]
    out = sampler(logits, states)
    assert out.token_ids == [5, int(logits[1].argmax())]


def test_biased_rows_are_not_plain_greedy() -> None:
    assert plain_greedy(_state(temperature=0.0))
    assert not plain_greedy(_state(temperature=0.0, logit_bias={1: 1.0}))
    assert not plain_greedy(_state(temperature=0.0, allowed_token_ids=[1]))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("logit_bias", {1: 100.5}, r"logit_bias\[1\] must be in \[-100.0, 100.0\]"),
    ("logit_bias", {1: float("nan")}, "finite"),
    ("logit_bias", {-1: 1.0}, r"logit_bias token id must be in \[0, "),
    ("logit_bias", {"5": 1.0}, "logit_bias token id must be an integer"),
    ("logit_bias", {True: 1.0}, "logit_bias token id must be an integer"),
    ("logit_bias", {i: 1.0 for i in range(4097)}, "at most 4096"),
    ("logit_bias", [1, 2], "must map"),
    ("allowed_token_ids", [], "1 to"),
    ("allowed_token_ids", [1, -2], r"allowed_token_ids entry must be in \[0, "),
    ("allowed_token_ids", [1.0], "allowed_token_ids entry"),
    ("allowed_token_ids", "12", "must be a list"),
])
def test_bad_biases_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_ids_outside_the_vocabulary_are_listed() -> None:
    params = SamplingParams(logit_bias={3: 1.0, 600: 1.0}, allowed_token_ids=[4, 512])
    assert params.token_ids_outside(512) == [600, 512]
    assert params.token_ids_outside(601) == []
