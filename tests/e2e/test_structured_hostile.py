"""Hostile constraints are refused or bounded: deep nesting, 10k properties, catastrophic regexes, 1 MB grammars."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("llguidance")

from flashllm.models.demo import demo_model_dir  # noqa: E402
from flashllm.models.tokenizer import load_tokenizer  # noqa: E402
from flashllm.sampling_params import MAX_STRUCTURED_CHARS, StructuredOutput  # noqa: E402
from flashllm.structured import GrammarCompiler, StructuredOutputError  # noqa: E402
from flashllm.structured.mask import unpack_bitmask  # noqa: E402


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = load_tokenizer(demo_model_dir())
    return GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _first_mask_s(compiler: GrammarCompiler, spec: StructuredOutput) -> float:
    import torch

    state = compiler.compile(spec).new_state()
    row = torch.zeros((compiler.vocab_size + 31) // 32, dtype=torch.int32)
    start = time.perf_counter()
    state.fill_bitmask(row)
    elapsed = time.perf_counter() - start
    assert unpack_bitmask(row.unsqueeze(0), compiler.vocab_size).any()
    return elapsed


def test_deep_nesting_is_refused(compiler: GrammarCompiler) -> None:
    with pytest.raises(StructuredOutputError, match="recursion|deep|nest"):
        compiler.compile(StructuredOutput(json=_deep(200)))
    with pytest.raises(ValueError, match="nested"):
        StructuredOutput(json=_deep(5000))  # too deep for json.dumps: refused while reading the request


def _props(count: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)},
            "required": [f"p{i}" for i in range(count)]}


def test_ten_thousand_properties_are_refused_and_five_thousand_bounded(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput(json=_props(10_000))  # 388 KB of schema: over the input bound
    start = time.perf_counter()
    compiled = compiler.compile(StructuredOutput(json=_props(5_000)))
    assert time.perf_counter() - start < 20  # 10k: 0.9 s on the 2-core VM with a 50k vocabulary
    assert compiler.compile(StructuredOutput(json=_props(5_000))) is compiled  # cached per constraint


@pytest.mark.parametrize("pattern", [r"(a|aa)*c{1,1000}", r"((a{1,50}){1,50}){1,50}", r"(x+x+)+y", r"(.*a){12}"])
def test_catastrophic_regexes_stay_bounded(compiler: GrammarCompiler, pattern: str) -> None:
    start = time.perf_counter()
    try:
        spec = StructuredOutput(regex=pattern)
        assert _first_mask_s(compiler, spec) < 2
    except StructuredOutputError as exc:  # refused by a lexer budget is as good as bounded
        assert "cannot be" in str(exc)
    assert time.perf_counter() - start < 20


def test_oversized_inputs_are_refused_before_compiling() -> None:
    big = "start: " + " | ".join(f'"w{i}"' for i in range(120_000))  # over 1 MB of grammar
    assert len(big) > 1 << 20
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput(grammar=big)
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput(json={"enum": ["x" * 1000] * (MAX_STRUCTURED_CHARS // 1000 + 1)})
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput(choice=[f"c{i}" for i in range(5000)])


def test_largest_accepted_grammar_is_bounded(compiler: GrammarCompiler) -> None:
    words, size = [], 0
    while size < MAX_STRUCTURED_CHARS - 1000:
        words.append(f'"w{len(words)}"')
        size += len(words[-1]) + 3
    start = time.perf_counter()
    try:
        compiler.compile(StructuredOutput(grammar="start: " + " | ".join(words)))
    except StructuredOutputError as exc:
        assert "cannot be" in str(exc)
    assert time.perf_counter() - start < 20
