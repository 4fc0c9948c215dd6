"""A request's sequences and their text-side state: sampling, detokenization, stop checks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from flashllm.core.bad_words import BadWordIds
from flashllm.core.detokenizer import IncrementalDetokenizer, StopChecker
from flashllm.core.pooling import embedding
from flashllm.core.sampler import SamplerOutput, SamplingState
from flashllm.core.sequence import FinishReason, Sequence
from flashllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashllm.sampling_params import SamplingParams
from flashllm.structured.compiler import CompiledGrammar


def prompt_token_ids(prompt: str | list[int], params: SamplingParams, tokenizer: Any) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt as its request runs it: a text encoded (ValueError without a tokenizer), then
    only the last params.truncate_prompt_tokens ids kept (vLLM's left truncation), a text then the kept ids'."""
    if isinstance(prompt, str) and tokenizer is None:
        raise ValueError("this model has no tokenizer: pass prompts as token ids")
    text, ids = (prompt, tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
    keep = params.truncate_prompt_tokens
    if keep is not None and len(ids) > keep:
        ids = ids[-keep:]
        text = None if text is None else tokenizer.decode(ids)
    return text, ids


@dataclass
class _SeqState:
    """Text-side state of one sequence of a request (no detokenizer when text is not wanted)."""

    sampling: SamplingState
    detokenizer: IncrementalDetokenizer | None
    stop: StopChecker
    completion: CompletionOutput
    emitted: int = 0  # characters of completion.text already reported as delta


class Request:
    """One user request: `n` sequences sharing a prompt (their full prompt blocks are shared
    through the prefix cache), plus the per-sequence state stop checks and outputs need."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_token_ids: list[int],
        device: torch.device,
        grammar: CompiledGrammar | None = None,
        bad_words_token_ids: BadWordIds = (),
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.seqs = [Sequence(request_id, prompt_token_ids, params) for _ in range(params.n)]
        self._states: dict[int, _SeqState] = {}
        for index, seq in enumerate(self.seqs):
            sampling = SamplingState.create(params, device, prompt_token_ids, eos_token_ids, index=index)
            sampling.grammar = grammar.new_state() if grammar is not None else None
            sampling.bad_words_token_ids = bad_words_token_ids
            detokenize = params.detokenize and tokenizer is not None
            self._states[seq.seq_id] = _SeqState(
                sampling=sampling,
                detokenizer=IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                if detokenize else None,
                stop=StopChecker(params.stop or [], params.include_stop_str_in_output),
                completion=CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None,
                                            top_logprobs=[] if params.logprobs else None),
            )

    def sampling_state(self, seq: Sequence) -> SamplingState:
        return self._states[seq.seq_id].sampling

    def on_token(
        self, seq: Sequence, sampled: SamplerOutput, row: int, now: float, max_model_len: int
    ) -> FinishReason | None:
        """Record the token `seq` just received; return why it must stop, if it must."""
        state = self._states[seq.seq_id]
        token = seq.last_token_id
        params, completion = self.params, state.completion
        state.sampling.output_token_ids.append(token)
        completion.token_ids.append(token)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
            self.metrics.num_cached_tokens = seq.num_cached_tokens
        if completion.logprobs is not None and sampled.logprobs is not None:
            completion.logprobs.append(sampled.logprobs[row])
            completion.cumulative_logprob += sampled.logprobs[row]
        if completion.top_logprobs is not None and sampled.top_logprobs is not None:
            completion.top_logprobs.append(sampled.top_logprobs[row])
        reason = self._stop_token(token, len(completion.token_ids), completion)
        grammar_reason = self._advance_grammar(state, token) if reason is None else None
        if state.detokenizer is not None and (reason is None or params.include_stop_str_in_output):
            if self._feed_text(state, state.detokenizer.add([token])):
                reason = FinishReason.STOP
        reason = reason or grammar_reason
        if reason is None and params.max_tokens is not None and len(completion.token_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and seq.num_tokens >= max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.finish(seq, reason)
        return reason

    @staticmethod
    def _advance_grammar(state: _SeqState, token: int) -> FinishReason | None:
        """Structured output: a complete grammar ends the output (the token is kept: it is text, or EOS);
        a refused token (never expected: the sampler masks) ends it as aborted rather than invalid."""
        grammar = state.sampling.grammar
        if grammar is None:
            return None
        if not grammar.accept(token):
            return FinishReason.ABORT
        return FinishReason.STOP if grammar.finished else None

    def _stop_token(self, token: int, num_output: int, completion: CompletionOutput) -> FinishReason | None:
        params = self.params
        if token in params.stop_token_ids:
            completion.stop_reason = token
            return FinishReason.STOP
        if token in self.eos_token_ids and not params.ignore_eos and num_output > params.min_tokens - 1:
            return FinishReason.STOP
        return None

    @staticmethod
    def _feed_text(state: _SeqState, delta: str) -> bool:
        """Pass new text through the stop-string checker; True when a stop string ended it."""
        if state.stop.finished:
            return True
        result = state.stop.feed(delta)
        state.completion.text += result.text
        if result.finished:
            state.completion.stop_reason = result.stop
        return result.finished

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark one sequence's completion finished (the scheduler frees its blocks)."""
        state = self._states[seq.seq_id]
        if state.completion.finish_reason is None:
            if state.detokenizer is not None and not state.stop.finished:
                # release text held back for incomplete UTF-8 or a possible stop-string prefix
                if not self._feed_text(state, state.detokenizer.flush()):
                    state.completion.text += state.stop.flush()
            state.completion.finish_reason = str(reason)
        if all(s.completion.finish_reason is not None for s in self._states.values()):
            self.metrics.finished_time = time.monotonic()

    @property
    def finished(self) -> bool:
        return all(s.completion.finish_reason is not None for s in self._states.values())

    def output(self) -> RequestOutput:
        """A snapshot for the caller; each completion's `delta` is the text since the last snapshot."""
        completions = []
        for state in self._states.values():
            c = state.completion
            delta, state.emitted = c.text[state.emitted:], len(c.text)
            completions.append(CompletionOutput(
                index=c.index, text=c.text, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=None if c.logprobs is None else list(c.logprobs),
                top_logprobs=None if c.top_logprobs is None else list(c.top_logprobs), delta=delta,
                cumulative_logprob=c.cumulative_logprob,
            ))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             self.metrics, self._prompt_logprobs(),
                             embedding(self.seqs[0]) if self.params.pooling is not None and self.finished else None)

    def _prompt_logprobs(self) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        """SamplingParams.prompt_logprobs: one entry per prompt token (None first), once the prompt has run."""
        if self.params.prompt_logprobs is None:
            return None
        found = self.seqs[0].prompt_logprobs or {}
        return [None] + [found.get(p) for p in range(1, len(self.prompt_token_ids))]
