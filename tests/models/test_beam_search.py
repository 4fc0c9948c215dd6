"""Beam search over the engine against a brute-force full-vocabulary beam search (transformers
forwards, or a synthetic distribution), plus greedy equivalence, EOS, batching and block reuse."""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.core.beam_search import BeamSearchOutput, beam_search
from flashllm.llm import LLM
from flashllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

STEPS = 8
PROMPT_LENGTHS = (3, 16, 29)  # below, at and across a 16-token block boundary

# rows(sequences) -> (N, V) float64 log-probabilities of the next token of each sequence.
LogprobFn = Callable[[list[list[int]]], torch.Tensor]


def brute_force_beam_search(logprob_fn: LogprobFn, prompt: list[int], beam_width: int, max_new: int,
                            length_penalty: float, eos: set[int]) -> list[tuple[float, float, tuple, str]]:
    """Beam search over the whole vocabulary, always run to max_new steps (no early stop).

    Candidates are ranked by cumulative logprob; EOS candidates within the top beam_width become
    hypotheses, the best beam_width others stay live. Returns (score, cumulative, tokens, reason)
    of the best beam_width hypotheses, best first.
    """
    beams: list[tuple[tuple, float]] = [((), 0.0)]
    hyps: list[tuple[float, float, tuple, str]] = []
    for _ in range(max_new):
        rows = logprob_fn([prompt + list(tokens) for tokens, _ in beams]).tolist()
        ranked = sorted(((cum + lp, tokens + (v,)) for (tokens, cum), row in zip(beams, rows, strict=True)
                         for v, lp in enumerate(row)), key=lambda c: -c[0])
        beams = []
        for rank, (cum, tokens) in enumerate(ranked):
            if tokens[-1] in eos:
                if rank < beam_width:
                    hyps.append((cum / len(tokens) ** length_penalty, cum, tokens, "stop"))
            elif len(beams) < beam_width:
                beams.append((tokens, cum))
        if not beams:
            break
    hyps += [(cum / len(tokens) ** length_penalty, cum, tokens, "length") for tokens, cum in beams]
    return sorted(hyps, key=lambda h: -h[0])[:beam_width]


def assert_same_beams(output: BeamSearchOutput, expected, atol: float) -> None:
    got = [(tuple(b.token_ids), b.finish_reason) for b in output.beams]
    assert got == [(tokens, reason) for _, _, tokens, reason in expected]
    for beam, (score, cum, _, _) in zip(output.beams, expected, strict=True):
        assert beam.cumulative_logprob == pytest.approx(cum, abs=atol)
        assert beam.score == pytest.approx(score, abs=atol)
        assert sum(beam.logprobs) == pytest.approx(beam.cumulative_logprob, abs=1e-9)


# --- the real engine against transformers ---------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("beam"), "llama", seed=5, tokenizer=False)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=96,
               max_model_len=512)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir: Path) -> LogprobFn:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def rows(sequences: list[list[int]]) -> torch.Tensor:
        # Full re-forward of every sequence (they have equal lengths within one step of one prompt).
        logits = model(torch.tensor(sequences)).logits[:, -1]
        return logits.double().log_softmax(dim=-1)

    return rows


@pytest.fixture
def engine(llm: LLM):
    yield llm.engine
    assert llm.engine.num_free_blocks() == llm.engine.block_manager.num_total_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_width_one_is_greedy(llm: LLM, engine, hf_logprobs: LogprobFn) -> None:
    prompts = _prompts(engine.parts.hf_config.vocab_size)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True,
                                                  logprobs=0, detokenize=False))
    outputs = beam_search(engine, prompts, 1, STEPS, ignore_eos=True)
    for prompt, want, got in zip(prompts, greedy, outputs, strict=True):
        assert len(got.beams) == 1
        assert got.beams[0].token_ids == want.outputs[0].token_ids
        assert got.beams[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-5)
        expected = brute_force_beam_search(hf_logprobs, prompt, 1, STEPS, 1.0, set())
        assert_same_beams(got, expected, atol=1e-4)


@pytest.mark.parametrize("beam_width", [2, 3])
def test_matches_brute_force_transformers(engine, hf_logprobs: LogprobFn, beam_width: int) -> None:
    prompts = _prompts(engine.parts.hf_config.vocab_size, seed=beam_width)
    outputs = beam_search(engine, prompts, beam_width, STEPS, ignore_eos=True)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert len(output.beams) == beam_width
        expected = brute_force_beam_search(hf_logprobs, prompt, beam_width, STEPS, 1.0, set())
        assert_same_beams(output, expected, atol=1e-4)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -0.5])
def test_eos_ends_hypotheses(engine, hf_logprobs: LogprobFn, length_penalty: float) -> None:
    prompts = _prompts(engine.parts.hf_config.vocab_size, seed=7)
    greedy = beam_search(engine, prompts, 1, 3, ignore_eos=True)
    for prompt, first in zip(prompts, greedy, strict=True):
        eos = first.beams[0].token_ids[2]  # a token the model likes here: some beam will end on it
        [output] = beam_search(engine, [prompt], 3, STEPS, length_penalty=length_penalty, eos_token_ids=[eos])
        expected = brute_force_beam_search(hf_logprobs, prompt, 3, STEPS, length_penalty, {eos})
        assert_same_beams(output, expected, atol=1e-4)
        if length_penalty <= 0:  # short hypotheses are not penalized: the early EOS must survive
            assert any(b.finish_reason == "stop" for b in output.beams)
        for beam in output.beams:
            assert (beam.token_ids[-1] == eos) == (beam.finish_reason == "stop")
            assert eos not in beam.token_ids[:-1]
            assert beam.score == pytest.approx(beam.cumulative_logprob / len(beam.token_ids) ** length_penalty)


def test_batched_prompts_match_one_at_a_time(engine) -> None:
    prompts = _prompts(engine.parts.hf_config.vocab_size, seed=11)
    batched = beam_search(engine, prompts, 2, STEPS, eos_token_ids=[prompts[0][-1]])
    for prompt, together in zip(prompts, batched, strict=True):
        [alone] = beam_search(engine, [prompt], 2, STEPS, eos_token_ids=[prompts[0][-1]])
        assert [b.token_ids for b in together.beams] == [b.token_ids for b in alone.beams]
        for a, b in zip(together.beams, alone.beams, strict=True):
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)


def test_default_eos_comes_from_the_model(engine) -> None:
    [eos] = engine.parts.eos_token_ids
    prompt = _prompts(engine.parts.hf_config.vocab_size)[1]
    [default] = beam_search(engine, [prompt], 2, 4)
    [explicit] = beam_search(engine, [prompt], 2, 4, eos_token_ids=[eos])
    assert [b.token_ids for b in default.beams] == [b.token_ids for b in explicit.beams]


def test_to_request_output(engine) -> None:
    prompt = _prompts(engine.parts.hf_config.vocab_size)[0]
    [output] = beam_search(engine, [prompt], 3, 4, ignore_eos=True)
    request = output.to_request_output("beam-0", n=2)
    assert request.finished and request.prompt_token_ids == prompt
    assert [c.token_ids for c in request.outputs] == [b.token_ids for b in output.beams[:2]]
    assert [c.cumulative_logprob for c in request.outputs] == [b.cumulative_logprob for b in output.beams[:2]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0), "beam_width"), (dict(beam_width=21), "beam_width"),
    (dict(beam_width=True), "beam_width"), (dict(max_tokens=0), "max_tokens"),
    (dict(length_penalty=math.nan), "length_penalty"), (dict(prompts=[[]]), "prompts"),
    (dict(prompts=[]), "prompts"), (dict(prompts=[[5] * 512]), "max_model_len"),
])
def test_rejects_bad_arguments(engine, kwargs, match: str) -> None:
    args = dict(prompts=[[5, 6]], beam_width=2, max_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        beam_search(engine, args.pop("prompts"), **args)


def test_engine_error_frees_blocks(engine) -> None:
    vocab = engine.parts.hf_config.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        beam_search(engine, [[5, 6, 7], [vocab + 1]], 2, 4)
    # the first prompt's request was queued before the second was refused: it must be gone


# --- a synthetic distribution: many shapes of search quickly ---------------------------------------

def random_logits(vocab: int, eos: Sequence[int] = (), eos_bias: float = 0.0, scale: float = 2.0,
                  salt: int = 0) -> Callable[[list[int]], list[float]]:
    """Next-token logits as a fixed function of the sequence: Gaussian draws seeded by its CRC,
    plus `eos_bias` on the EOS ids; a large `scale` gives peaked distributions."""
    def logits(tokens: list[int]) -> list[float]:
        rng = random.Random(zlib.crc32(bytes(str((salt, tokens)), "ascii")))
        return [rng.gauss(0.0, scale) + (eos_bias if v in eos else 0.0) for v in range(vocab)]

    return logits


class FakeEngine:
    """Duck-typed engine whose next-token logits are `logits_fn(sequence)`.

    Records every batch (the sequences submitted before each run_until_done).
    """

    def __init__(self, logits_fn: Callable[[list[int]], list[float]], eos: Sequence[int] = (),
                 max_model_len: int = 64) -> None:
        self.logits_fn, self.max_model_len = logits_fn, max_model_len
        self.parts = type("Parts", (), {"eos_token_ids": list(eos)})()
        self.pending: dict[str, tuple[list[int], SamplingParams]] = {}
        self.batches: list[list[list[int]]] = []

    def logprobs(self, sequences: list[list[int]]) -> torch.Tensor:
        rows = [self.logits_fn(tokens) for tokens in sequences]
        return torch.tensor(rows, dtype=torch.float64).log_softmax(dim=-1)

    def add_request(self, prompt: list[int], params: SamplingParams) -> str:
        assert len(prompt) < self.max_model_len and params.max_tokens == 1
        request_id = f"fake-{sum(map(len, self.batches)) + len(self.pending)}"
        self.pending[request_id] = (list(prompt), params)
        return request_id

    def run_until_done(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        assert set(request_ids) == set(self.pending), "every beam of the step should run in one batch"
        self.batches.append([tokens for tokens, _ in self.pending.values()])
        final = {}
        for request_id, (tokens, params) in self.pending.items():
            row = self.logprobs([tokens])[0]
            values, indices = row.topk(min(params.logprobs, row.numel()))
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
            completion = CompletionOutput(0, token_ids=[top[0][0]], top_logprobs=[top], finish_reason="length")
            final[request_id] = RequestOutput(request_id, None, tokens, [completion], True, RequestMetrics(0.0))
        self.pending.clear()
        return final

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(3, 9), beam_width=st.integers(1, 4), max_tokens=st.integers(1, 6),
       length_penalty=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]), num_eos=st.integers(0, 2),
       eos_bias=st.sampled_from([0.0, 2.0, 5.0]), scale=st.sampled_from([0.5, 2.0, 6.0]),
       ignore_eos=st.booleans(), salt=st.integers(0, 1000), num_prompts=st.integers(1, 3))
def test_synthetic_matches_brute_force(vocab, beam_width, max_tokens, length_penalty, num_eos, eos_bias,
                                       scale, ignore_eos, salt, num_prompts) -> None:
    eos = list(range(num_eos))
    engine = FakeEngine(random_logits(vocab, eos, eos_bias, scale, salt), eos)
    prompts = [[vocab - 1] * (i + 1) for i in range(num_prompts)]
    outputs = beam_search(engine, prompts, beam_width, max_tokens, length_penalty=length_penalty,
                          ignore_eos=ignore_eos)
    assert len(engine.batches) <= max_tokens
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = brute_force_beam_search(engine.logprobs, prompt, beam_width, max_tokens, length_penalty,
                                           set() if ignore_eos else set(eos))
        assert_same_beams(output, expected, atol=1e-9)
        scores = [b.score for b in output.beams]
        assert scores == sorted(scores, reverse=True)
        assert all(len(b.token_ids) <= max_tokens for b in output.beams)


def _scripted(first: list[float], later: list[float]) -> Callable[[list[int]], list[float]]:
    """Logits `first` for the first generated token (prompt [9]), `later` afterwards."""
    return lambda tokens: first if len(tokens) == 1 else later


def test_positive_length_penalty_searches_past_an_early_eos() -> None:
    # EOS first (logprob -0.31, score -0.31); the other beam then continues almost surely, and at
    # 6 tokens scores about -1.31 / 6**2 = -0.04: stopping at the early EOS would lose it.
    engine = FakeEngine(_scripted([1.0, 0.0, -20.0], [-20.0, 20.0, -20.0]), eos=[0])
    [output] = beam_search(engine, [[9]], 1, 6, length_penalty=2.0)
    assert_same_beams(output, brute_force_beam_search(engine.logprobs, [9], 1, 6, 2.0, {0}), atol=1e-9)
    assert output.beams[0].token_ids == [1] * 6


def test_eos_outside_the_top_beam_width_is_dropped() -> None:
    # EOS is second at every step; with one beam it never finishes, even though the lone EOS of
    # step 1 would outscore the 3-token beam.
    engine = FakeEngine(_scripted([-1.0, 0.0, -5.0], [-0.3, -0.2, 0.0]), eos=[0])
    [output] = beam_search(engine, [[9]], 1, 3, length_penalty=0.0)
    assert_same_beams(output, brute_force_beam_search(engine.logprobs, [9], 1, 3, 0.0, {0}), atol=1e-9)
    assert output.beams[0].finish_reason == "length"


def test_stops_early_once_no_live_beam_can_win() -> None:
    engine = FakeEngine(random_logits(8, [0], eos_bias=6.0), eos=[0])
    [output] = beam_search(engine, [[7]], 2, 20, length_penalty=0.0)
    assert len(engine.batches) < 5, "EOS is very likely: the search should finish in a few steps"
    expected = brute_force_beam_search(engine.logprobs, [7], 2, 20, 0.0, {0})
    assert_same_beams(output, expected, atol=1e-9)


def test_max_model_len_caps_generation() -> None:
    engine = FakeEngine(random_logits(6), max_model_len=10)
    outputs = beam_search(engine, [[5] * 7, [5] * 3], 2, 50)
    assert [len(b.token_ids) for b in outputs[0].beams] == [3, 3]
    assert [len(b.token_ids) for b in outputs[1].beams] == [7, 7]
    assert all(b.finish_reason == "length" for o in outputs for b in o.beams)
    assert max(len(seq) for batch in engine.batches for seq in batch) == 9
