"""logit_bias and allowed_token_ids through the engine: on the reference and cpu backends (whose greedy fast
paths must step aside for a biased row), beside unbiased requests in one batch, and under n-gram speculation."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

PROMPTS = [[11, 12, 13, 14, 15, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 40, 41]]
ALLOWED = [5, 17, 99, 130, 201]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("biases"), "llama", seed=6, tokenizer=False)


def _generate(model_dir: Path, backend: str | None, requests: list[tuple[list[int], SamplingParams]],
              speculative: dict | None = None) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", backend=backend, dtype="float32", block_size=16, num_kv_blocks=64,
              speculative_config=speculative)
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _params(**extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **extra)


@pytest.mark.parametrize("backend", ["reference", None])
def test_biased_rows_follow_their_bias_and_leave_the_others_alone(model_dir: Path, backend: str | None) -> None:
    plain = _generate(model_dir, backend, [(PROMPTS[1], _params())])[0]
    forced, allowed, unbiased = _generate(model_dir, backend, [
        (PROMPTS[0], _params(logit_bias={77: 100.0})),
        (PROMPTS[0], _params(allowed_token_ids=ALLOWED)),
        (PROMPTS[1], _params()),
    ])
    assert forced == [77] * 12
    assert set(allowed) <= set(ALLOWED)
    assert unbiased == plain and not set(plain) <= set(ALLOWED)
    banned = _generate(model_dir, backend, [(PROMPTS[1], _params(logit_bias={t: -100.0 for t in set(plain)}))])[0]
    assert not set(banned) & set(plain)


def test_the_backends_and_speculation_agree_under_a_bias(model_dir: Path) -> None:
    requests = [(PROMPTS[0], _params(allowed_token_ids=ALLOWED + PROMPTS[0])),
                (PROMPTS[1], _params(logit_bias={t: 3.0 for t in PROMPTS[1]}))]
    reference = _generate(model_dir, "reference", requests)
    assert _generate(model_dir, None, requests) == reference
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert _generate(model_dir, "reference", requests, ngram) == reference


def test_ids_outside_the_vocabulary_are_refused(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64)
    vocab = llm.engine.parts.hf_config.vocab_size
    with pytest.raises(ValueError, match=rf"token ids \[{vocab}\] outside the vocabulary \[0, {vocab}\)"):
        llm.generate([PROMPTS[0]], _params(logit_bias={vocab: 1.0}), use_tqdm=False)
