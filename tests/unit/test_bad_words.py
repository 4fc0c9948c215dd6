"""bad_words (vLLM's) and truncate_prompt_tokens: validation, the tokenization of a word, and the sampler's ban
checked against a brute-force reading of the rule; speculative verify rows see their drafts as generated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.core.bad_words import tokenize_bad_words
from flashllm.core.sampler import Sampler, SamplingState, plain_greedy
from flashllm.core.spec.verify import verify
from flashllm.sampling_params import MAX_TOKENS_LIMIT, SamplingParams

sampler = Sampler()
VOCAB = 12


def _state(words: tuple[tuple[int, ...], ...], output: list[int], **params: object) -> SamplingState:
    state = SamplingState.create(SamplingParams(**{"temperature": 0.0, **params}), "cpu", [1, 2, 3])
    state.bad_words_token_ids = words
    state.output_token_ids = list(output)
    return state


def _oracle(words: tuple[tuple[int, ...], ...], output: list[int]) -> set[int]:
    """Tokens t whose choice would make the output end with a whole bad word (the word lying in the output)."""
    return {t for t in range(VOCAB) for w in words
            if len(w) <= len(output) + 1 and (output + [t])[len(output) + 1 - len(w):] == list(w)}


words_st = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3).map(tuple), max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(words=words_st, output=st.lists(st.integers(0, VOCAB - 1), max_size=6), seed=st.integers(0, 2**16))
def test_exactly_the_tokens_that_would_complete_a_bad_word_are_banned(words, output, seed) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))
    processed = Sampler.process(logits, [_state(words, output)])[0]
    banned = _oracle(words, output)
    assert {t for t in range(VOCAB) if processed[t] == float("-inf")} == banned
    kept = [t for t in range(VOCAB) if t not in banned]
    assert torch.equal(processed[kept], logits[0, kept])


def test_a_multi_token_word_is_banned_only_right_after_its_prefix() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 3] = 5.0, 4.0  # 7 is the greedy choice, 3 the next best
    words = ((5, 6, 7),)
    assert sampler(logits, [_state(words, [])]).token_ids == [7]
    assert sampler(logits, [_state(words, [5])]).token_ids == [7]
    assert sampler(logits, [_state(words, [1, 5, 6])]).token_ids == [3]
    assert sampler(logits, [_state(words, [5, 6, 1])]).token_ids == [7]
    assert sampler(logits, [_state(((7,),), [])]).token_ids == [3]  # a one-token word: always


def test_rows_keep_their_own_words_and_a_sampled_row_never_draws_a_banned_token() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 3.0
    rows = [_state(((4,),), []), _state((), [])]
    assert sampler(logits, rows).token_ids == [int(logits[0, :4].argmax()), 4]
    draws = {sampler(logits[:1], [_state(((4,),), [], seed=s, temperature=1.0)]).token_ids[0] for s in range(200)}
    assert 4 not in draws and len(draws) > 1


def test_rows_with_bad_words_are_not_plain_greedy() -> None:
    assert plain_greedy(_state((), []))
    assert not plain_greedy(_state(((4,),), []))


def test_a_verify_row_after_j_drafts_sees_them_as_generated() -> None:
    # row 0 follows the output [1]; row 1 follows the draft 5; row 2 follows 5, 6. The word (5, 6) bans 6 only
    # where 5 was just generated: at row 1, whose context holds the draft, not the output.
    logits = torch.zeros(3, VOCAB)
    logits[0, 5] = logits[1, 6] = logits[2, 8] = 5.0
    logits[:, 2] = 1.0
    (verified,) = verify(sampler, logits, [_state(((5, 6),), [1])], [[5, 6]])
    assert verified.token_ids == [5, 2] and verified.num_accepted == 1


class _CharTokenizer:
    """One token per character (its code point): a word after a space is a different sequence."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [ord(c) for c in text]


def test_a_word_is_banned_as_written_and_after_a_space_once_each() -> None:
    ids = tokenize_bad_words(["ab", "  ab", "c"], _CharTokenizer())
    assert sorted(ids) == sorted([(97, 98), (32, 97, 98), (99,), (32, 99)])


def test_bad_words_need_a_tokenizer() -> None:
    assert tokenize_bad_words(None, None) == ()
    with pytest.raises(ValueError, match="bad_words needs the model's tokenizer"):
        tokenize_bad_words(["x"], None)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("bad_words", ["w"] * 129, "at most 128"),
    ("bad_words", "word", "bad_words must be a list"),
    ("bad_words", ["ok", "x" * 257], r"bad_words\[1\] must be a string of 1 to 256"),
    ("bad_words", [""], r"bad_words\[0\]"),
    ("bad_words", ["  \n"], r"bad_words\[0\] .*not only whitespace"),
    ("bad_words", [5], r"bad_words\[0\]"),
    ("truncate_prompt_tokens", 0, r"truncate_prompt_tokens must be in \[1, "),
    ("truncate_prompt_tokens", -3, r"truncate_prompt_tokens must be in \[1, "),
    ("truncate_prompt_tokens", MAX_TOKENS_LIMIT + 1, "truncate_prompt_tokens must be in"),
    ("truncate_prompt_tokens", True, "truncate_prompt_tokens must be an integer"),
    ("truncate_prompt_tokens", 2.0, "truncate_prompt_tokens must be an integer"),
])
def test_bad_values_are_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_good_values_are_kept() -> None:
    params = SamplingParams(bad_words=("a", "b c"), truncate_prompt_tokens=1)
    assert params.bad_words == ["a", "b c"] and params.truncate_prompt_tokens == 1
    assert SamplingParams(bad_words=["x" * 256] * 128).bad_words is not None
