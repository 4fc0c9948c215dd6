"""Structured output after a think block (StructuredOutput.reasoning_parser): the block is free text, the
constraint holds from `</think>` on, for think tags spelt as text and held as added tokens (Qwen3, DeepSeek-R1)."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

import torch  # noqa: E402
from tokenizers import AddedToken  # noqa: E402

from flashllm.sampling_params import REASONING_PARSERS, StructuredOutput  # noqa: E402
from flashllm.structured.compiler import GrammarCompiler  # noqa: E402
from flashllm.structured.mask import unpack_bitmask  # noqa: E402
from flashllm.testing.tokenizer import train_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# every constraint kind, with a reply it accepts
KINDS = [
    (StructuredOutput(json=SCHEMA), '{"a": 12}'),
    (StructuredOutput(json_object=True), '{"k": "v"}'),
    (StructuredOutput(regex=r"ans [a-z]+\."), "ans abc."),
    (StructuredOutput(choice=["yes", "no"]), "no"),
    (StructuredOutput(grammar='start: "x" NUM ";"\nNUM: /[0-9]+/'), "x12;"),
    (StructuredOutput(grammar='root ::= "x" [0-9]+ ";"'), "x3;"),
]
# thinking the constraint must not touch: braces, a cut-off tag, the word "think", newlines
THOUGHT = "Let me see {not json} </th ink\n\nso <think the answer"


@pytest.fixture(scope="module", params=["text tags", "added tokens"])
def compiler(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    tok = train_tokenizer(tmp_path_factory.mktemp("tok"), 512)
    if request.param == "added tokens":  # as Qwen3's and DeepSeek-R1's tokenizers hold them
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
        assert len(tok.encode("<think></think>")) == 2
    else:
        assert len(tok.encode("</think>")) > 1
    return GrammarCompiler(tok, [0], len(tok))


def _accepts(compiler: GrammarCompiler, spec: StructuredOutput, text: str) -> tuple[int, int, bool]:
    """(tokens of `text`, how many leading ones the grammar's masks allow in turn, whether it is complete after
    all of them): each token is checked against the mask the sampler would apply, then consumed."""
    tokens = compiler._tokenizer.encode(text)
    state = compiler.compile(spec).new_state()
    row = torch.empty((compiler.vocab_size + 31) // 32, dtype=torch.int32)
    for i, token in enumerate(tokens):
        state.compute_bitmask(row)
        if not unpack_bitmask(row[None], compiler.vocab_size)[0, token] or not state.accept(token):
            return len(tokens), i, False
    return len(tokens), len(tokens), state.finished


@pytest.mark.parametrize("parser", REASONING_PARSERS)
@pytest.mark.parametrize(("spec", "reply"), KINDS, ids=[s.kind for s, _ in KINDS])
def test_the_think_block_is_free_and_the_reply_after_it_constrained(compiler: GrammarCompiler, parser: str,
                                                                    spec: StructuredOutput, reply: str) -> None:
    wrapped = StructuredOutput(**{spec.kind: getattr(spec, spec.kind)}, reasoning_parser=parser)
    n, allowed, done = _accepts(compiler, wrapped, f"<think>{THOUGHT}</think>\n\n{reply}")
    assert (allowed, done) == (n, True)
    # the same text without the wrap: the thought is refused at once, so the wrap is what lets it through
    assert _accepts(compiler, spec, f"<think>{THOUGHT}</think>\n\n{reply}")[1] == 0
    # after the block the constraint holds: a reply it refuses stops at the reply
    block = compiler._tokenizer.encode(f"<think>{THOUGHT}</think>\n\n")
    assert compiler._tokenizer.encode(f"<think>{THOUGHT}</think>\n\n#{reply}")[:len(block)] == block
    n, allowed, done = _accepts(compiler, wrapped, f"<think>{THOUGHT}</think>\n\n#{reply}")
    assert (allowed, done) == (len(block), False)


def test_qwen3_replies_may_skip_the_block_deepseek_r1_replies_are_thinking_until_the_tag(
        compiler: GrammarCompiler) -> None:
    spec = {"json": SCHEMA}
    n, allowed, done = _accepts(compiler, StructuredOutput(**spec, reasoning_parser="qwen3"), '{"a": 1}')
    assert (allowed, done) == (n, True)  # thinking was off: the reply is the constrained text
    n, allowed, done = _accepts(compiler, StructuredOutput(**spec, reasoning_parser="deepseek_r1"), '{"a": 1}')
    assert (allowed, done) == (n, False)  # still thinking: the template opened the block
    n, allowed, done = _accepts(compiler, StructuredOutput(**spec, reasoning_parser="deepseek_r1"),
                                'plan it</think>{"a": 1}')
    assert (allowed, done) == (n, True)  # DeepSeek-R1's reply starts inside the block
    # qwen3: a reply that does not start with <think> is constrained from its first token
    assert _accepts(compiler, StructuredOutput(**spec, reasoning_parser="qwen3"), 'plan it</think>{"a": 1}')[1] == 0


def test_at_most_two_newlines_separate_the_block_from_the_reply(compiler: GrammarCompiler) -> None:
    spec = StructuredOutput(json=SCHEMA, reasoning_parser="qwen3")
    for newlines in ("", "\n", "\n\n"):
        n, allowed, done = _accepts(compiler, spec, f'<think>x</think>{newlines}{{"a": 1}}')
        assert (allowed, done) == (n, True)
    n, allowed, _ = _accepts(compiler, spec, '<think>x</think>\n\n\n{"a": 1}')
    assert allowed < n


def test_a_constraint_with_and_without_the_block_are_cached_apart(compiler: GrammarCompiler) -> None:
    plain = compiler.compile(StructuredOutput(json=SCHEMA))
    after = compiler.compile(StructuredOutput(json=SCHEMA, reasoning_parser="qwen3"))
    assert plain is not after
    assert compiler.compile(StructuredOutput(json=SCHEMA, reasoning_parser="qwen3")) is after


def test_an_unknown_reasoning_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        StructuredOutput(json=SCHEMA, reasoning_parser="r1")

