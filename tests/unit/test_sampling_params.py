"""SamplingParams validation: every field bounded, finite and clearly reported."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashllm.sampling_params import SamplingParams, per_prompt

# The documented ranges, restated independently of the module: (low, high, low excluded).
FLOAT_RANGES = {
    "temperature": (0.0, 100.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
}
INT_RANGES = {"n": (1, 128), "logprobs": (0, 20), "seed": (0, 2**63 - 1), "max_tokens": (1, 1_000_000)}


def _inside(value: float, lo: float, hi: float, lo_open: bool) -> bool:
    return (lo < value if lo_open else lo <= value) and value <= hi


@pytest.mark.parametrize("name", sorted(FLOAT_RANGES))
@given(value=st.floats(allow_nan=False, allow_infinity=False, min_value=-200, max_value=200))
def test_float_fields_accept_exactly_their_range(name: str, value: float) -> None:
    lo, hi, lo_open = FLOAT_RANGES[name]
    if _inside(value, lo, hi, lo_open):
        assert getattr(SamplingParams(**{name: value}), name) == value
    else:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})


@pytest.mark.parametrize("name", sorted(FLOAT_RANGES))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", None, True])
def test_float_fields_reject_non_finite_and_non_numbers(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", sorted(INT_RANGES))
def test_int_fields_have_inclusive_bounds(name: str) -> None:
    lo, hi = INT_RANGES[name]
    for ok in (lo, hi):
        kwargs = {name: ok, "min_tokens": 0}
        assert getattr(SamplingParams(**kwargs), name) == ok
    for bad in (lo - 1, hi + 1, 1.0, True, "3"):
        with pytest.raises(ValueError, match=f"{name} must be") as info:
            SamplingParams(**{name: bad})
        assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_error_names_field_value_and_range() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=1.5)
    assert str(info.value) == "top_p must be in (0.0, 1.0], got 1.5"


@pytest.mark.parametrize("top_k", [-2, 1 << 21, 2.0])
def test_top_k_range(top_k: object) -> None:
    for ok in (-1, 0, 1, 50):
        assert SamplingParams(top_k=ok).top_k == ok
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=top_k)


def test_optional_fields_accept_none() -> None:
    params = SamplingParams(seed=None, max_tokens=None, logprobs=None, stop=None)
    assert params.stop == [] and params.max_tokens is None


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, 5\]"):
        SamplingParams(max_tokens=5, min_tokens=6)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)


@given(stop=st.text(min_size=1, max_size=1024) | st.lists(st.text(min_size=1, max_size=50), max_size=16))
def test_stop_is_normalized_to_a_list(stop: str | list[str]) -> None:
    params = SamplingParams(stop=stop)
    assert params.stop == ([stop] if isinstance(stop, str) else stop)
    assert params.max_stop_str_len == max((len(s) for s in params.stop), default=0)


@pytest.mark.parametrize("stop", [[""], "", ["x"] * 17, ["y" * 1025], [3], {"a": 1}, 5])
def test_bad_stop_strings(stop: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("ids", [[-1], [1.5], [True], "12", [0] * 1025, [2**31]])
def test_bad_stop_token_ids(ids: object) -> None:
    assert SamplingParams(stop_token_ids=[0, 5, 2**31 - 1]).stop_token_ids == [0, 5, 2**31 - 1]
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=ids)


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                                  "detokenize", "use_beam_search"])
def test_bool_fields_must_be_bools(name: str) -> None:
    assert getattr(SamplingParams(**{name: True}), name) is True
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: 1})


def test_beam_search_fields() -> None:
    assert SamplingParams(use_beam_search=True, n=3).num_beams == 3
    assert SamplingParams(use_beam_search=True, n=2, beam_width=4).num_beams == 4
    with pytest.raises(ValueError, match="beam_width .* must be >= n"):
        SamplingParams(use_beam_search=True, n=4, beam_width=2)
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(beam_width=2)
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(use_beam_search=True, length_penalty=math.nan)


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-3, False), (1.0, False)])
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_from_generation_config() -> None:
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05,
              "max_new_tokens": 64, "min_p": None, "bos_token_id": 1, "eos_token_id": [2, 3]}
    params = SamplingParams.from_generation_config(config)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert (params.repetition_penalty, params.max_tokens, params.min_p) == (1.05, 64, 0.0)
    assert SamplingParams.from_generation_config({**config, "do_sample": False}).is_greedy
    assert not SamplingParams.from_generation_config({"temperature": 0.7}).is_greedy
    overridden = SamplingParams.from_generation_config(config, temperature=0.0, seed=3)
    assert overridden.is_greedy and overridden.seed == 3 and overridden.top_p == 0.9
    assert SamplingParams.from_generation_config(None) == SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0.0})


def test_per_prompt_gives_each_prompt_its_params() -> None:
    default, greedy, hot = SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)
    assert per_prompt(None, 3, default) == [default, default, default]
    assert per_prompt(greedy, 2, default) == [greedy, greedy]
    assert per_prompt((greedy, hot), 2, default) == [greedy, hot]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        per_prompt([hot], 2, default)
