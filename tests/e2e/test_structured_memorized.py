"""Structured output on a tiny model taught to break every constraint: the mask must win over what the model wants.

The model memorized, for each JSON schema, regex and choice case, a line that breaks it
(flashllm.testing.structured_checks.MEMORIZED_*): unconstrained, it writes those lines and the
independent oracles reject every one; constrained, every output that stops validates and every
cut-off one is a valid prefix; with the mask disabled (mutation), the checks fail for every case.
The default run sends 2 requests per case; the slow run (nox -s slow) 20, over 500 JSON requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("regex")
pytest.importorskip("llguidance")

from flashllm.llm import LLM  # noqa: E402
from flashllm.models.tokenizer import load_tokenizer  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.memorize import memorize  # noqa: E402
from flashllm.testing.structured_checks import Case, all_cases, memorized_prompt, run_cases  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

CASES = all_cases()
TAUGHT = [c for c in CASES if c.memorized is not None]
# sampling settings the mask must compose with (n > 1 included); the first is greedy
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0, n=2), dict(temperature=0.7, top_p=0.9, top_k=50),
            dict(temperature=1.3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_model(tmp_path_factory.mktemp("structured-memorized"), "qwen2", seed=3)
    tokenizer = load_tokenizer(path)
    eos = [tokenizer.eos_token_id]
    pairs = [(tokenizer.encode(memorized_prompt(c), add_special_tokens=False),
              tokenizer.encode(c.memorized, add_special_tokens=False) + eos) for c in TAUGHT]
    loss = memorize(path, pairs, steps=400)
    assert loss < 0.05, f"the tiny model did not learn its lines (loss {loss:.3f})"
    return path


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256)


def _requests(per_case: int) -> list[tuple[Case, str, SamplingParams]]:
    """per_case requests for every case: even ones on the case's own memorized prompt (the model wants to
    write the line that breaks this very case), odd ones on another case's prompt; settings rotate."""
    out = []
    for i, case in enumerate(CASES):
        for r in range(per_case):
            source = case if r % 2 == 0 and case.memorized is not None else TAUGHT[(i + r) % len(TAUGHT)]
            params = SamplingParams(max_tokens=MAX_TOKENS, seed=1000 * i + r, structured_output=case.spec,
                                    **SETTINGS[r % len(SETTINGS)])
            out.append((case, memorized_prompt(source), params))
    return out


def test_unconstrained_the_model_writes_its_lines_and_the_oracles_reject_them(llm: LLM) -> None:
    """The premise: without a constraint the model says exactly what breaks each case."""
    outputs = llm.generate([memorized_prompt(c) for c in TAUGHT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for case, output in zip(TAUGHT, outputs, strict=True):
        text = output.outputs[0].text
        assert text == case.memorized, (case.name, text)
        assert case.check(text, "stop") is not None, f"{case.name}: the taught line {text!r} passes its own check"


def test_constrained_outputs_validate(llm: LLM) -> None:
    result = run_cases(llm, _requests(per_case=2))
    assert not result.problems, "\n".join(result.problems[:10])
    # most outputs must finish: a test where everything is cut off would prove little
    assert result.counts.get("stop", 0) >= 0.6 * result.total, result.counts


def test_disabling_the_mask_fails_every_case(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: with the sampler's mask off, greedy decoding writes the taught lines and every case fails."""
    import flashllm.core.sampler as sampler

    monkeypatch.setattr(sampler, "apply_grammar_masks", lambda logits, grammars: None)
    requests = [(c, memorized_prompt(c), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_output=c.spec))
                for c in TAUGHT]
    result = run_cases(llm, requests)
    failed = {p.split(":", 1)[0] for p in result.problems}
    assert failed == {c.name for c in TAUGHT}, sorted({c.name for c in TAUGHT} - failed)


def test_speculative_decoding_leaves_constrained_rows_exact(model_dir: Path, llm: LLM) -> None:
    """With n-gram speculation on, constrained rows (never drafted: their grammar would have to advance through
    the drafts) give the tokens they give without it, beside unconstrained rows that are drafted."""
    spec_llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    requests = _requests(per_case=1)  # greedy, each on its own case's prompt
    free = [(None, memorized_prompt(c) + " " + c.memorized * 3, SamplingParams(max_tokens=24, temperature=0))
            for c in TAUGHT[:4]]
    prompts = [p for _, p, _ in requests + free]
    params = [sp for _, _, sp in requests + free]
    plain = [o.outputs[0].text for o in llm.generate(prompts, params)]
    drafted = [o.outputs[0].text for o in spec_llm.generate(prompts, params)]
    assert drafted == plain
    assert not run_cases(spec_llm, requests).problems
    assert spec_llm.engine.speculator.stats.num_drafted > 0  # the free rows were drafted


@pytest.mark.slow
def test_many_requests(llm: LLM) -> None:
    """The acceptance run: 20 requests per case, over 500 on the JSON schemas alone."""
    requests = _requests(per_case=20)
    assert sum(1 for c, _, _ in requests if c.name.startswith("json")) >= 500
    result = run_cases(llm, requests)
    assert not result.problems, "\n".join(result.problems[:10])
    assert result.counts.get("stop", 0) >= 0.6 * result.total, result.counts
