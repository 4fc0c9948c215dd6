"""Beam search over the engine: every live beam is a one-token request scored by top logprobs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashllm.sampling_params import MAX_ABS_LENGTH_PENALTY, MAX_LOGPROBS, SamplingParams

# Each beam asks the engine for its top logprobs, which the sampler caps; a beam must be able to
# offer at least beam_width continuations, so beam_width shares the cap.
MAX_BEAM_WIDTH = MAX_LOGPROBS


class _EngineLike(Protocol):
    max_model_len: int
    parts: Any  # for parts.eos_token_ids

    def add_request(self, prompt: list[int], params: SamplingParams) -> str: ...
    def run_until_done(self, request_ids: list[str]) -> dict[str, RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...


@dataclass(slots=True)
class BeamHypothesis:
    """One finished beam: generated tokens only (EOS included when it ended on one).

    `logprobs[i]` is the log-probability of token_ids[i]; `cumulative_logprob` is their sum;
    `score` is `beam_search_score(cumulative_logprob, len(token_ids), length_penalty)`;
    `finish_reason` is "stop" (ended on EOS) or "length" (max_tokens or max_model_len).
    """

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass(slots=True)
class BeamSearchOutput:
    """The best `beam_width` hypotheses of one prompt, best score first."""

    prompt_token_ids: list[int]
    beams: list[BeamHypothesis]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    def to_request_output(self, request_id: str, n: int | None = None, tokenizer: Any = None) -> RequestOutput:
        """The `n` best beams (all by default) as a finished RequestOutput, text decoded when a
        tokenizer is given (special tokens skipped)."""
        completions = []
        for index, beam in enumerate(self.beams[:n]):
            text = tokenizer.decode(beam.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=list(beam.token_ids), finish_reason=beam.finish_reason,
                logprobs=list(beam.logprobs), cumulative_logprob=beam.cumulative_logprob, delta=text,
            ))
        return RequestOutput(request_id, None, list(self.prompt_token_ids), completions, True, self.metrics)


def beam_search_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """Length-normalized score of a hypothesis: `cumulative_logprob / length ** length_penalty`.

    `length` counts generated tokens (EOS included). length_penalty > 0 favours longer
    hypotheses, < 0 shorter ones, 0 ranks by cumulative logprob alone.
    """
    return cumulative_logprob / (max(length, 1) ** length_penalty)


@dataclass(slots=True)
class _Beam:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    def extend(self, token_id: int, logprob: float) -> _Beam:
        return _Beam([*self.token_ids, token_id], [*self.logprobs, logprob], self.cumulative_logprob + logprob)


class _PromptSearch:
    """Live beams and finished hypotheses of one prompt."""

    def __init__(self, prompt: list[int], beam_width: int, max_len: int, length_penalty: float,
                 eos_token_ids: frozenset[int]) -> None:
        self.prompt = prompt
        self.beam_width = beam_width
        self.max_len = max_len  # tokens this prompt may generate (max_tokens and max_model_len)
        self.length_penalty = length_penalty
        self.eos_token_ids = eos_token_ids
        self.live: list[_Beam] = [_Beam()]
        self.finished: list[BeamHypothesis] = []
        self.metrics = RequestMetrics(arrival_time=time.monotonic())

    @property
    def done(self) -> bool:
        return not self.live

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """Extend the live beams by their top continuations; `tops[i]` belongs to `live[i]`."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()
        candidates = [(beam, token, logprob) for beam, top in zip(self.live, tops, strict=True) for token, logprob in top]
        # Stable sort: equal totals keep beam order, then the engine's likelihood order.
        candidates.sort(key=lambda c: c[0].cumulative_logprob + c[2], reverse=True)
        live: list[_Beam] = []
        for rank, (parent, token, logprob) in enumerate(candidates):
            child = parent.extend(token, logprob)
            if token in self.eos_token_ids:
                # As in transformers: an EOS outside the top beam_width candidates is dropped.
                if rank < self.beam_width:
                    self._add_finished(child, "stop")
            else:
                live.append(child)
                if len(live) == self.beam_width:
                    break
        self.live = live
        if self.live and len(self.live[0].token_ids) >= self.max_len:
            for beam in self.live:
                self._add_finished(beam, "length")
            self.live = []
        if self._cannot_improve():
            self.live = []
        if self.done:
            self.metrics.finished_time = time.monotonic()

    def _add_finished(self, beam: _Beam, reason: str) -> None:
        score = beam_search_score(beam.cumulative_logprob, len(beam.token_ids), self.length_penalty)
        self.finished.append(BeamHypothesis(beam.token_ids, beam.logprobs, beam.cumulative_logprob, score, reason))
        self.finished.sort(key=lambda h: (h.score, h.cumulative_logprob), reverse=True)
        del self.finished[self.beam_width:]

    def _cannot_improve(self) -> bool:
        """True when beam_width hypotheses are finished and no descendant of a live beam can
        outscore the worst of them.

        Logprobs are <= 0, so a descendant's cumulative logprob c' <= c of its live ancestor and
        its length L' lies in [L + 1, max_len]. With length_penalty p > 0 the score c' / L'^p is
        at most c / max_len^p; with p <= 0 it is at most c / (L + 1)^p. This is an exact bound
        (transformers' early_stopping="never"), so stopping never changes the result.
        """
        if len(self.finished) < self.beam_width:
            return False
        best = max((self._best_attainable(beam) for beam in self.live), default=-math.inf)
        return best <= self.finished[-1].score

    def _best_attainable(self, beam: _Beam) -> float:
        length = self.max_len if self.length_penalty > 0 else len(beam.token_ids) + 1
        return beam_search_score(beam.cumulative_logprob, length, self.length_penalty)

    def output(self) -> BeamSearchOutput:
        return BeamSearchOutput(self.prompt, list(self.finished), self.metrics)


def _check_args(engine: _EngineLike, prompts: list[list[int]], beam_width: int, max_tokens: int,
                length_penalty: float) -> None:
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (each beam asks for "
                         f"its top logprobs, capped at {MAX_LOGPROBS}), got {beam_width!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not abs(length_penalty) <= MAX_ABS_LENGTH_PENALTY:
        raise ValueError(f"length_penalty must be a finite number in [-{MAX_ABS_LENGTH_PENALTY}, "
                         f"{MAX_ABS_LENGTH_PENALTY}], got {length_penalty!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists, one per prompt")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {prompt!r:.60}")
        if len(prompt) >= engine.max_model_len:
            raise ValueError(f"prompts[{i}] has {len(prompt)} tokens; max_model_len is {engine.max_model_len}, "
                             "which must leave room for at least one generated token")


def _top_logprobs(engine: _EngineLike, sequences: list[list[int]], num_logprobs: int
                  ) -> list[list[tuple[int, float]]]:
    """Submit every sequence as a one-token greedy request in one batch; each one's top
    (token_id, logprob) pairs, most likely first."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=num_logprobs, ignore_eos=True,
                            detokenize=False)
    request_ids: list[str] = []
    try:
        for tokens in sequences:
            request_ids.append(engine.add_request(tokens, params))
        final = engine.run_until_done(request_ids)
    except BaseException:
        for request_id in request_ids:  # never leave half-run requests holding KV blocks
            engine.abort(request_id)
        raise
    missing = [r for r in request_ids if r not in final]
    if missing:
        raise RuntimeError(f"the engine stopped before finishing beam requests {missing[:5]}; "
                           "were they aborted from another thread?")
    return [final[r].outputs[0].top_logprobs[0] for r in request_ids]


def beam_search(
    engine: _EngineLike,
    prompts: list[list[int]],
    beam_width: int,
    max_tokens: int,
    *,
    length_penalty: float = 1.0,
    eos_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids); the best `beam_width` hypotheses per prompt.

    Each step, every live beam of every prompt is one greedy request (max_tokens=1, top-k
    logprobs) and all of them run in one engine batch; the prefix cache shares the full KV
    blocks beams have in common, so only each beam's last partial block is recomputed.
    Candidates are ranked by cumulative logprob; the best beam_width that do not end on EOS stay
    live, and those that end on EOS within the top beam_width become finished hypotheses scored
    by `beam_search_score` (transformers' rules). A prompt stops once it has beam_width finished
    hypotheses no live beam can beat (an exact bound, as transformers' early_stopping="never"),
    when no beam is live, or at max_tokens / max_model_len, where the live beams finish with
    reason "length".

    k = min(beam_width + max(beam_width, number of EOS ids), 20): enough continuations per beam
    that EOS ids never crowd out a live beam (transformers' 2 * beam_width can lose some), unless
    k hits the engine's cap of 20 logprobs.

    eos_token_ids: None means the model's (engine.parts.eos_token_ids); ignore_eos treats EOS
    as an ordinary token. Returns one BeamSearchOutput per prompt, in prompt order, each with
    up to beam_width beams sorted by score, best first.
    """
    _check_args(engine, prompts, beam_width, max_tokens, length_penalty)
    if ignore_eos:
        eos: frozenset[int] = frozenset()
    else:
        eos = frozenset(engine.parts.eos_token_ids if eos_token_ids is None else eos_token_ids)
    searches = [
        _PromptSearch(list(prompt), beam_width, min(max_tokens, engine.max_model_len - len(prompt)),
                      float(length_penalty), eos)
        for prompt in prompts
    ]
    num_logprobs = min(beam_width + max(beam_width, len(eos)), MAX_LOGPROBS)
    while active := [s for s in searches if not s.done]:
        sequences = [s.prompt + beam.token_ids for s in active for beam in s.live]
        tops = iter(_top_logprobs(engine, sequences, num_logprobs))
        for search in active:
            search.advance([next(tops) for _ in search.live])
    return [search.output() for search in searches]
