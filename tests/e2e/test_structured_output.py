"""Structured output on the random demo model: every finished output validates, every cut-off one is a valid prefix.

The oracles are independent of flashllm.structured and llguidance (flashllm/testing/structured.py):
json + the jsonschema package, the regex package's partial matching, and plain string checks for
choices. A mutation check turns the sampler's mask off and expects these same checks to fail.
"""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
regex = pytest.importorskip("regex")
pytest.importorskip("llguidance")

from flashllm.llm import LLM  # noqa: E402
from flashllm.models.demo import demo_model_dir  # noqa: E402
from flashllm.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from flashllm.testing.structured import CHOICES, JSON_SCHEMAS, REGEXES, is_json_prefix  # noqa: E402
from flashllm.testing.structured_checks import choice_problems, json_problems, regex_problems  # noqa: E402

PROMPTS = ["Hello", "The weather today", "{", "Answer:", "1 2 3"]
# sampling settings the mask must compose with (n > 1 included)
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0, n=2), dict(temperature=0.7, top_p=0.9, top_k=50),
            dict(temperature=1.3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(demo_model_dir()), device="cpu", dtype="float32", max_model_len=256)


def _requests(specs: list[StructuredOutput], per_spec: int, max_tokens: int) -> list[tuple[str, SamplingParams]]:
    out = []
    for s, spec in enumerate(specs):
        for r in range(per_spec):
            setting = SETTINGS[(s + r) % len(SETTINGS)]
            params = SamplingParams(max_tokens=max_tokens, seed=1000 * s + r, structured_output=spec, **setting)
            out.append((PROMPTS[(s + 2 * r) % len(PROMPTS)], params))
    return out


def _run(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> list[list[tuple[str, str | None]]]:
    outputs = llm.generate([p for p, _ in requests], [params for _, params in requests])
    return [[(c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def check_all(llm: LLM, per_spec: int, max_tokens: int) -> tuple[list[str], dict[str, int]]:
    """Run JSON, regex and choice requests; the problems found and the finish reasons counted."""
    problems: list[str] = []
    counts: dict[str, int] = {}
    cases = ([(StructuredOutput(json=s), lambda t, r, s=s: json_problems(s, t, r)) for s in JSON_SCHEMAS]
             + [(StructuredOutput(regex=p), lambda t, r, p=p: regex_problems(p, t, r)) for p in REGEXES]
             + [(StructuredOutput(choice=c), lambda t, r, c=c: choice_problems(c, t, r)) for c in CHOICES])
    requests = _requests([spec for spec, _ in cases], per_spec, max_tokens)
    results = _run(llm, requests)
    for i, completions in enumerate(results):
        check = cases[i // per_spec][1]
        for text, reason in completions:
            counts[str(reason)] = counts.get(str(reason), 0) + 1
            problem = check(text, reason)
            if problem is not None:
                problems.append(f"{cases[i // per_spec][0].kind} #{i // per_spec}: {problem}")
    return problems, counts


def test_every_output_validates_or_is_a_valid_prefix(llm: LLM) -> None:
    assert len(JSON_SCHEMAS) >= 25
    problems, counts = check_all(llm, per_spec=2, max_tokens=48)
    assert not problems, "\n".join(problems[:10])
    total = sum(counts.values())
    assert total >= 2 * (len(JSON_SCHEMAS) + len(REGEXES) + len(CHOICES))
    # most outputs must finish: a test where everything is cut off would prove little
    assert counts.get("stop", 0) >= 0.6 * total, counts


def test_disabling_the_mask_fails_the_checks(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: with the sampler's mask off, the same oracles must find broken outputs."""
    import flashllm.core.sampler as sampler

    monkeypatch.setattr(sampler, "apply_grammar_masks", lambda logits, grammars: None)
    problems, _ = check_all(llm, per_spec=1, max_tokens=24)
    assert len(problems) > 10, problems


def test_grammar_and_json_object(llm: LLM) -> None:
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "<" [a-z]+ ">"'
    outs = llm.generate(["x", "y"], [
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_output=StructuredOutput(grammar=grammar)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=6, structured_output=StructuredOutput(grammar=gbnf))])
    for out, pattern in zip(outs, [r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", "<[a-z]+>"], strict=True):
        problem = regex_problems(pattern, out.outputs[0].text, out.outputs[0].finish_reason)
        assert problem is None, problem
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=64, temperature=1.0, seed=7,
                                                        structured_output=StructuredOutput(json_object=True)))
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.text.startswith("{") and is_json_prefix(c.text), c.text


def test_bad_constraints_are_refused_before_any_token(llm: LLM) -> None:
    cases = [StructuredOutput(json={"type": "strng"}), StructuredOutput(regex="(a"),
             StructuredOutput(regex=r"a(?=b)"), StructuredOutput(grammar="start: undefined_rule"),
             StructuredOutput(json="{not json")]
    for spec in cases:
        with pytest.raises(ValueError, match="cannot be"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=spec))
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, n=2, structured_output=StructuredOutput(regex="a+"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["b"])


@pytest.mark.slow
def test_many_requests(llm: LLM) -> None:
    """The acceptance run (nox -s slow): 20 requests per case, over 500 on the JSON schemas alone."""
    problems, counts = check_all(llm, per_spec=20, max_tokens=96)
    assert 20 * len(JSON_SCHEMAS) >= 500
    assert not problems, "\n".join(problems[:10])
    assert counts.get("stop", 0) >= 0.6 * sum(counts.values()), counts


def test_masks_are_computed_while_the_forward_runs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's masks start on the worker thread before its forward returns (each forward waits until they
    have: were they computed after it, in the sampler, it would time out), and the tokens are the same."""
    import threading

    from flashllm.structured import mask

    spec = StructuredOutput(regex="[a-z]{3}( [a-z]{2,6}){4}")
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=11, structured_output=spec)
    monkeypatch.setattr(mask, "PREFETCH", False)
    after = llm.generate(["Hello"], params)[0].outputs[0]
    monkeypatch.setattr(mask, "PREFETCH", True)

    started = threading.Semaphore(0)
    mask_threads: list[str] = []
    waits: list[bool] = []
    compute = mask.GrammarState.compute_bitmask

    def counted_compute(self: mask.GrammarState, row: object) -> None:
        mask_threads.append(threading.current_thread().name)
        started.release()
        compute(self, row)

    runner = llm.engine.runner
    forward = runner._forward

    def waiting_forward(inputs: object) -> object:
        # a generous timeout: the worker starts within milliseconds even on a loaded machine
        waits.append(started.acquire(timeout=60 if all(waits) else 0))
        return forward(inputs)

    monkeypatch.setattr(mask.GrammarState, "compute_bitmask", counted_compute)
    monkeypatch.setattr(runner, "_forward", waiting_forward)
    during = llm.generate(["Hello"], params)[0].outputs[0]
    assert waits and all(waits), waits
    assert len(mask_threads) == len(waits) and all(name.startswith("flashllm-grammar-mask") for name in mask_threads)
    assert (during.text, during.finish_reason) == (after.text, after.finish_reason)
    assert regex_problems(spec.regex, during.text, during.finish_reason) is None
