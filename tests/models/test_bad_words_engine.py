"""bad_words and truncate_prompt_tokens through the engine on a tiny model with a trained tokenizer: a word the
greedy output holds is gone with bad_words, on the reference and cpu backends (whose greedy fast paths must step
aside) and under n-gram speculation; a truncated prompt runs as its last k tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashllm.core.bad_words import tokenize_bad_words
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time there was"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bad_words"), "llama", seed=7)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return _llm(model_dir, "reference")


def _llm(model_dir: Path, backend: str | None, speculative: dict | None = None) -> LLM:
    return LLM(str(model_dir), device="cpu", backend=backend, dtype="float32", block_size=16, num_kv_blocks=64,
               speculative_config=speculative)


def _params(**extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, **extra)


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def _contains(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


def _held_words(llm: LLM, ids: list[int], text: str) -> list[str]:
    """Words of the output whose bad-word token sequences the output holds, longest sequence first."""
    held = [w for w in dict.fromkeys(text.split())
            if any(_contains(ids, seq) for seq in tokenize_bad_words([w], llm.engine.tokenizer))]
    return sorted(held, key=lambda w: -max(len(s) for s in tokenize_bad_words([w], llm.engine.tokenizer)))


@pytest.fixture(scope="module")
def banned(llm: LLM) -> list[SamplingParams]:
    """Per prompt: bad_words naming a multi-token word (if any) and a one-token word the free output holds."""
    params = []
    for out in llm.generate(PROMPTS, _params(), use_tqdm=False):
        held = _held_words(llm, out.outputs[0].token_ids, out.outputs[0].text)
        assert held, f"the free output {out.outputs[0].text!r} holds no whole word to ban"
        params.append(_params(bad_words=[held[0], held[-1]]))
    return params


def test_a_banned_word_leaves_the_greedy_output(llm: LLM, banned: list[SamplingParams]) -> None:
    assert any(len(s) > 1 for p in banned for s in tokenize_bad_words(p.bad_words, llm.engine.tokenizer))
    free = _tokens(llm, [_params()] * len(PROMPTS))
    for ids, params, free_ids in zip(_tokens(llm, banned), banned, free, strict=True):
        sequences = tokenize_bad_words(params.bad_words, llm.engine.tokenizer)
        assert any(_contains(free_ids, s) for s in sequences)
        assert not any(_contains(ids, s) for s in sequences), (params.bad_words, ids)
        assert len(ids) == len(free_ids)


def test_the_cpu_backend_gives_the_reference_tokens(model_dir: Path, llm: LLM, banned: list[SamplingParams]) -> None:
    assert _tokens(_llm(model_dir, None), banned) == _tokens(llm, banned)


def test_speculation_gives_the_tokens_plain_steps_give(model_dir: Path, llm: LLM) -> None:
    # repetitive prompts, so n-gram drafts get accepted and a word's prefix may be a draft a verify row follows;
    # every multi-token word the free outputs hold is banned, one request each, all in one batch
    prompts = [*PROMPTS, "d dhi d dhi d dhi d dhi", "hi hi hi hi"]
    requests = []
    for prompt, out in zip(prompts, llm.generate(prompts, _params(), use_tqdm=False), strict=True):
        for word in _held_words(llm, out.outputs[0].token_ids, out.outputs[0].text):
            if max(len(s) for s in tokenize_bad_words([word], llm.engine.tokenizer)) > 1:
                requests.append((prompt, _params(bad_words=[word])))
    assert len(requests) >= 4

    def run(engine: LLM) -> list[list[int]]:
        outs = engine.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        return [out.outputs[0].token_ids for out in outs]

    assert run(_llm(model_dir, "reference", NGRAM)) == run(llm)


def test_a_truncated_prompt_runs_as_its_last_tokens(llm: LLM) -> None:
    ids = llm.engine.tokenizer.encode(PROMPTS[0])
    whole = llm.generate([ids[-4:]], _params(), use_tqdm=False)[0]
    out = llm.generate([PROMPTS[0]], _params(truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:] and out.outputs[0].token_ids == whole.outputs[0].token_ids
    assert out.prompt == llm.engine.tokenizer.decode(ids[-4:])
    longer = llm.generate([ids], _params(truncate_prompt_tokens=len(ids) + 5), use_tqdm=False)[0]
    assert longer.prompt_token_ids == ids


def test_bad_words_need_a_tokenizer(tmp_path: Path) -> None:
    ids_only = LLM(str(build_tiny_model(tmp_path, "llama", seed=7, tokenizer=False)), device="cpu",
                   dtype="float32", block_size=16, num_kv_blocks=64)
    with pytest.raises(ValueError, match="bad_words needs the model's tokenizer"):
        ids_only.generate([[5, 6, 7]], _params(bad_words=["x"]), use_tqdm=False)
