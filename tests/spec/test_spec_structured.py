"""Speculative decoding with structured output: drafts are cut to what the grammar allows, each verify row is
masked by the grammar after the drafts before it, and the tokens equal those of plain decoding (greedy and
seeded sampling) while every finished output validates against independent oracles."""

from __future__ import annotations

import pytest

pytest.importorskip("jsonschema")
pytest.importorskip("regex")
pytest.importorskip("llguidance")

from flashllm.core.spec import verify  # noqa: E402
from flashllm.llm import LLM  # noqa: E402
from flashllm.models.demo import demo_model_dir  # noqa: E402
from flashllm.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from flashllm.testing.structured import CHOICES, JSON_SCHEMAS, REGEXES  # noqa: E402
from flashllm.testing.structured_checks import choice_problems, json_problems, regex_problems  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = ["Hello", "The weather today", "{", "Answer:", "1 2 3"]
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0, n=2), dict(temperature=0.7, top_p=0.9, top_k=50),
            dict(temperature=1.3, repetition_penalty=1.3, frequency_penalty=0.5)]
# text the grammar forces to repeat, so the n-gram lookup finds drafts that the model then keeps
REPEATS = [r"(the river runs north, )+the end\.", r'\[("ab", ){2,6}"ab"\]']


def _cases() -> list[tuple[StructuredOutput, object]]:
    return ([(StructuredOutput(json=s), lambda t, r, s=s: json_problems(s, t, r)) for s in JSON_SCHEMAS[:12]]
            + [(StructuredOutput(regex=p), lambda t, r, p=p: regex_problems(p, t, r)) for p in REGEXES + REPEATS]
            + [(StructuredOutput(choice=c), lambda t, r, c=c: choice_problems(c, t, r)) for c in CHOICES])


def _run(llm: LLM) -> tuple[list[list[list[int]]], list[str]]:
    """Every case under every setting: the token ids of each completion and the oracles' problems."""
    cases = _cases()
    requests = [(PROMPTS[(i + r) % len(PROMPTS)],
                 SamplingParams(max_tokens=40, seed=100 * i + r, structured_output=spec, **SETTINGS[(i + r) % 4]))
                for i, (spec, _) in enumerate(cases) for r in range(2)]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    problems = []
    for k, out in enumerate(outputs):
        check = cases[k // 2][1]
        problems += [f"case {k // 2}: {p}" for c in out.outputs if (p := check(c.text, c.finish_reason))]
    return [[list(c.token_ids) for c in out.outputs] for out in outputs], problems


@pytest.fixture(scope="module")
def plain() -> list[list[list[int]]]:
    tokens, problems = _run(LLM(str(demo_model_dir()), device="cpu", dtype="float32", max_model_len=256))
    assert not problems, problems[:5]
    return tokens


def _speculating() -> LLM:
    return LLM(str(demo_model_dir()), device="cpu", dtype="float32", max_model_len=256, speculative_config=NGRAM)


def test_structured_tokens_with_drafts_equal_plain_decoding(plain: list[list[list[int]]]) -> None:
    llm = _speculating()
    tokens, problems = _run(llm)
    stats = llm.engine.speculator.stats
    assert not problems, problems[:5]
    assert stats.num_accepted > 20 and stats.num_drafted > stats.num_accepted, stats
    assert tokens == plain


def test_rows_masked_as_the_first_one_break_it(plain: list[list[list[int]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: every verify row masked with the grammar where the round starts (not after its drafts)."""
    monkeypatch.setattr(verify, "row_states", lambda states, drafts: [
        row for state, draft in zip(states, drafts, strict=True)
        for row in [state] + [verify.replace(state, output_token_ids=state.output_token_ids + draft[:j])
                              for j in range(1, len(draft) + 1)]])
    tokens, problems = _run(_speculating())
    assert problems or tokens != plain
