"""Sampler: greedy, filters, penalties, seeds and logprobs against independent computations."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flashllm.core.sampler import (
    Sampler,
    SamplingState,
    _top_k_top_p_full_sort,
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k_top_p,
)
from flashllm.sampling_params import SamplingParams

sampler = Sampler()


def _state(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
           eos: tuple[int, ...] = ()) -> SamplingState:
    state = SamplingState.create(params, "cpu", prompt or [], eos_token_ids=eos)
    state.output_token_ids.extend(output or [])
    return state


def _logits(seed: int, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- greedy and logprobs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 6), vocab=st.integers(2, 300),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_greedy_takes_the_argmax(seed: int, rows: int, vocab: int, dtype: torch.dtype) -> None:
    logits = _logits(seed, rows, vocab).to(dtype)
    out = sampler(logits, [_state(SamplingParams(temperature=0.0)) for _ in range(rows)])
    for row, token in zip(logits.float().tolist(), out.token_ids, strict=True):
        assert row[token] == max(row)


def _special_rows(vocab: int, seed: int) -> torch.Tensor:
    """Rows where the argmax has to choose: ties, NaNs (which win), +-inf and an all -inf row."""
    rows = _logits(seed, 6, vocab).round()  # rounding to integers makes ties likely
    rows[1, vocab // 2] = rows[1, vocab - 1] = float("nan")
    rows[2, :] = float("-inf")
    rows[3, [0, vocab - 1]] = float("inf")
    rows[4, :] = 1.0
    return rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(2, 3000), start=st.integers(0, 1))
def test_cpu_runner_argmax_is_torchs_argmax(seed: int, vocab: int, start: int) -> None:
    from flashllm.backends.cpu.runner import numpy_argmax as argmax

    rows = _special_rows(vocab + start, seed)
    for view in (rows, rows[:, start:], rows.t().contiguous().t(), rows.half(), rows[:, :0]):
        if view.shape[1] == 0:
            with pytest.raises((IndexError, RuntimeError)):
                argmax(view)
            continue
        got = argmax(view)
        assert got.dtype == torch.int64 and got.tolist() == view.argmax(dim=-1).tolist()


def test_sampler_takes_every_token_through_the_given_argmax() -> None:
    from flashllm.backends.cpu.runner import numpy_argmax

    calls: list[tuple[int, ...]] = []

    def counted(rows: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(rows.shape))
        return numpy_argmax(rows)

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(temperature=1.0, seed=8)]
    logits = _logits(3, len(params), 500)
    states = lambda: [_state(p, [1, 2], [3]) for p in params]  # noqa: E731  fresh generators each run
    assert Sampler(counted)(logits, states()).token_ids == Sampler()(logits, states()).token_ids
    assert sorted(calls) == [(2, 500), (2, 500)]  # the greedy rows once, the sampled rows' race once
    calls.clear()
    plain = [_state(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler(counted)(logits[:3], plain).token_ids == logits[:3].argmax(dim=-1).tolist()
    assert calls == [(3, 500)]


def test_plain_greedy_rows_skip_processing_but_penalised_rows_do_not() -> None:
    # the all-plain-greedy shortcut must not swallow a penalty or a min_tokens ban in the batch
    logits = torch.full((2, 5), 0.5)
    logits[:, 3] = 1.0
    plain = _state(SamplingParams(temperature=0.0), output=[3])
    penalised = _state(SamplingParams(temperature=0.0, repetition_penalty=4.0), output=[3])
    banned = _state(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]), output=[1])
    assert sampler(logits, [plain, plain]).token_ids == [3, 3]
    assert sampler(logits, [plain, penalised]).token_ids == [3, 0]  # 1 / 4 < 0.5: token 0 wins
    assert sampler(logits, [banned, plain]).token_ids == [0, 3]


def _naive_processed(row: list[float], state: SamplingState) -> list[float]:
    """The documented order, one token at a time in float64."""
    p = state.params
    seen = set(state.prompt_token_ids) | set(state.output_token_ids)
    counts = Counter(state.output_token_ids)
    out = []
    for tok, x in enumerate(row):
        if tok in seen and p.repetition_penalty != 1.0:
            x = x * p.repetition_penalty if x < 0 else x / p.repetition_penalty
        x -= p.frequency_penalty * counts[tok] + p.presence_penalty * (counts[tok] > 0)
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(state.eos_token_ids))
        if len(state.output_token_ids) < p.min_tokens and tok in banned:
            x = -math.inf
        out.append(x / (1.0 if p.is_greedy else p.temperature))
    return out


def _log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    repetition_penalty=st.sampled_from([1.0, 0.8, 1.3, 2.0]),
    frequency_penalty=st.sampled_from([0.0, -0.5, 0.7]),
    presence_penalty=st.sampled_from([0.0, 1.0, -1.5]),
    min_tokens=st.integers(0, 4),
    stop_token_ids=st.lists(st.integers(0, 19), max_size=2),
    logprobs=st.integers(0, 5),
    seed=st.integers(0, 1000),
)


@settings(max_examples=60, deadline=None)
@given(params=st.lists(params_strategy, min_size=1, max_size=4), seed=st.integers(0, 2**31),
       data=st.data())
def test_logprobs_follow_the_documented_processing_order(params: list[SamplingParams], seed: int,
                                                         data: st.DataObject) -> None:
    vocab = 20
    states = []
    for p in params:
        prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        output = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        states.append(_state(p, prompt, output, eos=(3,)))
    logits = _logits(seed, len(states), vocab)
    out = sampler(logits, states)
    for i, state in enumerate(states):
        expected = _log_softmax(_naive_processed(logits[i].tolist(), state))
        token = out.token_ids[i]
        assert expected[token] > -math.inf, "sampled a token the penalties/min_tokens forbid"
        assert out.logprobs[i] == pytest.approx(expected[token], abs=1e-4)
        k = state.params.logprobs
        assert [t for t, _ in out.top_logprobs[i]] == sorted(range(vocab), key=lambda t: -expected[t])[:k]
        for t, lp in out.top_logprobs[i]:
            assert lp == pytest.approx(expected[t], abs=1e-4)
        if state.params.is_greedy:
            assert expected[token] == max(expected)


def test_no_logprobs_requested_returns_none() -> None:
    out = sampler(_logits(0, 2, 10), [_state(SamplingParams()), _state(SamplingParams(temperature=0))])
    assert out.logprobs is None and out.top_logprobs is None


# ---------------------------------------------------------------- penalties vs transformers / loops


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), penalty=st.floats(0.2, 5.0), data=st.data())
def test_repetition_penalty_matches_transformers(seed: int, penalty: float, data: st.DataObject) -> None:
    vocab, rows = 40, 3
    logits = _logits(seed, rows, vocab)
    seqs = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)) for _ in range(rows)]
    states = [_state(SamplingParams(repetition_penalty=penalty), s[:len(s) // 2], s[len(s) // 2:])
              for s in seqs]
    ours = logits.clone()
    apply_repetition_penalty(ours, states)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, s in enumerate(seqs):
        expected = hf(torch.tensor([s]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], expected)


def test_frequency_and_presence_penalties_match_naive_loops() -> None:
    vocab = 30
    logits = _logits(7, 2, vocab)
    outputs = [[1, 1, 1, 5, 7, 7], [2, 29, 29]]
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.25),
              SamplingParams(frequency_penalty=-1.0, presence_penalty=0.0)]
    ours = logits.clone()
    apply_frequency_presence_penalties(ours, [_state(p, [3, 4], o) for p, o in zip(params, outputs, strict=True)])
    for i, (p, o) in enumerate(zip(params, outputs, strict=True)):
        counts = Counter(o)
        for t in range(vocab):
            want = logits[i, t].item() - p.frequency_penalty * counts[t] - p.presence_penalty * (t in counts)
            assert ours[i, t].item() == pytest.approx(want, abs=1e-5)


# ---------------------------------------------------------------- filters vs transformers


TOP_K_TOP_P = {"partial": apply_top_k_top_p, "full": _top_k_top_p_full_sort}


@pytest.mark.parametrize("impl", sorted(TOP_K_TOP_P))
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), ks=st.lists(st.integers(1, 60) | st.just(50), min_size=1, max_size=4),
       ps=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4), ties=st.booleans())
def test_top_k_top_p_masks_match_transformers(impl: str, seed: int, ks: list[int], ps: list[float],
                                              ties: bool) -> None:
    vocab = 50
    logits = _logits(seed, len(ks), vocab)
    if ties:  # coarse values, as bf16 logits often are: many ties at the k-th value
        logits = logits.round()
    ours = logits.clone()
    TOP_K_TOP_P[impl](ours, torch.tensor(ks).clamp(max=vocab), torch.tensor(ps[:len(ks)]))
    for i, (k, p) in enumerate(zip(ks, ps[:len(ks)], strict=True)):
        top_k_only = TopKLogitsWarper(k)(None, logits[i:i + 1].clone())
        expected = TopPLogitsWarper(p)(None, top_k_only.clone())
        if ties:  # which of two equal logits top-p drops is arbitrary: compare sizes
            # with tied logits the cumulative probabilities hit exact fractions (1/3, 2/3, ...); a p within
            # float rounding of one keeps or drops the tie by the last bit of either implementation's sum
            kept = torch.softmax(top_k_only[0], -1).sort(descending=True).values.cumsum(0)
            assume(bool((kept - p).abs().min() > 1e-6))
            assert not torch.isinf(ours[i:i + 1])[torch.isinf(top_k_only)].logical_not().any()
            assert int(torch.isinf(ours[i]).sum()) == int(torch.isinf(expected).sum()), (k, p)
        else:
            assert torch.equal(torch.isinf(ours[i:i + 1]), torch.isinf(expected)), (k, p)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), min_p=st.floats(0.0, 1.0))
def test_min_p_mask_matches_transformers(seed: int, min_p: float) -> None:
    logits = _logits(seed, 2, 64)
    ours = logits.clone()
    apply_min_p(ours, torch.tensor([min_p, min_p]))
    expected = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))


def _naive_allowed(row: list[float], p: SamplingParams) -> tuple[set[int], set[int]]:
    """(allowed tokens, tokens too close to a threshold to judge) after top-k, top-p, min-p."""
    scaled = [x / p.temperature for x in row]
    order = sorted(range(len(row)), key=lambda t: -scaled[t])
    k = p.top_k if p.top_k > 0 else len(row)
    kept = [t for t in order if scaled[t] >= scaled[order[min(k, len(row)) - 1]]]
    z = sum(math.exp(scaled[t] - scaled[order[0]]) for t in kept)
    probs = {t: math.exp(scaled[t] - scaled[order[0]]) / z for t in kept}
    allowed, borderline, tail = set(), set(), 1.0
    for rank, t in enumerate(kept):  # descending: tail = probability of t and everything below
        margin = tail - (1 - p.top_p)
        if rank == 0 or margin > 1e-5:
            allowed.add(t)
        elif margin > -1e-5:
            borderline.add(t)
        tail -= probs[t]
    z = sum(probs[t] for t in allowed | borderline)
    top = max(probs.values()) / z
    for t in list(allowed):
        ratio = probs[t] / z - p.min_p * top
        if ratio < -1e-6:
            allowed.discard(t)
        elif ratio < 1e-6:
            allowed.discard(t)
            borderline.add(t)
    return allowed, borderline


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), top_k=st.sampled_from([-1, 1, 2, 5, 17]),
       top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.05, 0.3]),
       temperature=st.sampled_from([0.3, 1.0, 2.0]), draw_seed=st.integers(0, 2**40))
def test_filters_never_sample_outside_the_allowed_set(seed: int, top_k: int, top_p: float, min_p: float,
                                                     temperature: float, draw_seed: int) -> None:
    vocab = 24
    logits = _logits(seed, 1, vocab).repeat(16, 1)
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature, seed=draw_seed)
    states = [SamplingState.create(params, "cpu", [], index=i) for i in range(16)]
    allowed, borderline = _naive_allowed(logits[0].tolist(), params)
    for token in sampler(logits, states).token_ids:
        assert token in allowed | borderline


# ---------------------------------------------------------------- distribution and seeds


def _chi_square(counts: Counter[int], probs: list[float], n: int) -> float:
    return sum((counts[t] - n * q) ** 2 / (n * q) for t, q in enumerate(probs) if q > 0)


@pytest.mark.parametrize("top_k", [-1, 3])
def test_many_seeded_draws_follow_the_distribution(top_k: int) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    temperature, n = 0.8, 4000
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=12345)
    states = [SamplingState.create(params, "cpu", [], index=i) for i in range(n)]
    counts = Counter(sampler(logits.repeat(n, 1), states).token_ids)
    weights = [math.exp(x / temperature) for x in logits[0].tolist()]
    if top_k > 0:
        weights = [w if rank < top_k else 0.0 for rank, w in enumerate(weights)]  # logits are sorted
    probs = [w / sum(weights) for w in weights]
    assert all(counts[t] == 0 for t, q in enumerate(probs) if q == 0)
    # 7 degrees of freedom: P(chi2 > 30) < 1e-4, so a correct sampler essentially never fails.
    assert _chi_square(counts, probs, n) < 30


def _generate(states_fn, steps: int, target: int, vocab: int, batch_logits_seed: int) -> list[int]:
    """Run `steps` sampler calls; return the tokens of row `target`, its logits fixed per step."""
    states = states_fn()
    tokens = []
    for step in range(steps):
        logits = _logits(batch_logits_seed + step, len(states), vocab)
        logits[target] = _logits(step, 1, vocab, scale=1.0)[0]  # the needle's logits depend on step only
        out = sampler(logits, states)
        for state, token in zip(states, out.token_ids, strict=True):
            state.output_token_ids.append(token)
        tokens.append(out.token_ids[target])
    return tokens


@settings(max_examples=15, deadline=None)
@given(others=st.lists(st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.0]),
                                 top_p=st.sampled_from([1.0, 0.8]),
                                 seed=st.none() | st.integers(0, 100)), max_size=5),
       position=st.integers(0, 5), noise_seed=st.integers(0, 1000))
def test_same_seed_same_tokens_alone_or_in_any_batch(others: list[SamplingParams], position: int,
                                                     noise_seed: int) -> None:
    needle = SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.1, seed=424242)
    vocab, steps = 200, 12
    alone = _generate(lambda: [_state(needle, [1, 2, 3])], steps, 0, vocab, noise_seed)
    position = min(position, len(others))

    def batch() -> list[SamplingState]:
        states = [_state(p, [4, 5]) for p in others]
        states.insert(position, _state(needle, [1, 2, 3]))
        return states

    assert _generate(batch, steps, position, vocab, noise_seed + 1) == alone


def test_different_seeds_and_siblings_draw_different_streams() -> None:
    vocab, steps = 1000, 10

    def run(seed: int, index: int = 0) -> list[int]:
        p = SamplingParams(temperature=1.0, seed=seed)
        return _generate(lambda: [SamplingState.create(p, "cpu", [], index=index)], steps, 0, vocab, 0)

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(1, index=1) != run(1, index=0)


def test_unseeded_requests_follow_the_global_rng() -> None:
    p = SamplingParams(temperature=1.0)
    torch.manual_seed(0)
    first = _generate(lambda: [_state(p), _state(p)], 6, 0, 500, 0)
    torch.manual_seed(0)
    assert _generate(lambda: [_state(p), _state(p)], 6, 0, 500, 0) == first
    assert SamplingState.create(SamplingParams(temperature=0), "cpu", []).generator is None


# ---------------------------------------------------------------- min_tokens and errors


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_token_ids(temperature: float) -> None:
    eos, stop_id, vocab = 3, 7, 16
    params = SamplingParams(temperature=temperature, min_tokens=4, stop_token_ids=[stop_id], seed=0)
    state = _state(params, [1, 2], eos=(eos,))
    logits = torch.zeros(1, vocab)
    logits[0, eos] = logits[0, stop_id] = 30.0  # overwhelmingly likely when allowed
    for _ in range(4):
        token = sampler(logits, [state]).token_ids[0]
        assert token not in (eos, stop_id)
        state.output_token_ids.append(token)
    assert sampler(logits, [state]).token_ids[0] in (eos, stop_id)


def test_ignore_eos_leaves_eos_to_the_engine_but_still_masks_stop_ids() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    logits = torch.zeros(1, 8)
    logits[0, 3] = 10.0
    logits[0, 5] = 20.0
    assert sampler(logits, [_state(params, eos=(3,))]).token_ids == [3]


def test_rejects_logits_that_do_not_match_the_states() -> None:
    with pytest.raises(ValueError, match="one row per state"):
        sampler(torch.zeros(3, 10), [_state(SamplingParams())])


@pytest.mark.parametrize("impl", sorted(TOP_K_TOP_P))
def test_top_p_edges_follow_transformers(impl: str) -> None:
    # Two equal tokens at top_p=0.5: the cumulative mass reaches 0.5 exactly, so one is dropped.
    logits = torch.zeros(1, 2)
    ours = logits.clone()
    TOP_K_TOP_P[impl](ours, torch.tensor([2]), torch.tensor([0.5]))
    expected = TopPLogitsWarper(0.5)(None, logits.clone())
    assert int(torch.isinf(ours).sum()) == int(torch.isinf(expected).sum()) == 1
    # A vanishing top_p (1 - top_p rounds to 1 in fp32) still keeps one token.
    ours = logits.clone()
    TOP_K_TOP_P[impl](ours, torch.tensor([2]), torch.tensor([1e-9]))
    expected = TopPLogitsWarper(1e-9)(None, logits.clone())
    assert int(torch.isfinite(ours).sum()) == int(torch.isfinite(expected).sum()) == 1


def test_large_vocab_paths_agree() -> None:
    # A realistic vocabulary: top-k 40 + top-p takes the partial sort, top-k off the full one.
    logits = _logits(11, 3, 32_000)
    k, p = torch.tensor([40, 1, 40]), torch.tensor([0.9, 0.5, 1.0])
    partial, full = logits.clone(), logits.clone()
    apply_top_k_top_p(partial, k, p)
    _top_k_top_p_full_sort(full, k, p)
    assert torch.equal(torch.isinf(partial), torch.isinf(full))
    off = logits.clone()
    apply_top_k_top_p(off, torch.tensor([32_000, 40, 32_000]), torch.tensor([0.9, 0.9, 0.3]))
    for i, (kk, pp) in enumerate([(32_000, 0.9), (40, 0.9), (32_000, 0.3)]):
        expected = TopPLogitsWarper(pp)(None, TopKLogitsWarper(kk)(None, logits[i:i + 1].clone()))
        assert torch.equal(torch.isinf(off[i:i + 1]), torch.isinf(expected))
