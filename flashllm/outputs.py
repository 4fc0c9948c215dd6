"""What generation returns: per-request outputs with per-sequence completions and timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (a request has `n` of them, or `beam_width`).

    text / token_ids are cumulative; `delta` is the text added by the step that produced this
    output (what a stream sends). logprobs[i] is the chosen token's logprob at step i;
    top_logprobs[i] lists (token_id, logprob) of the most likely tokens when requested.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    delta: str = ""
    cumulative_logprob: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (or at the end of generation)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts
    # it), else (the token's logprob, [(token_id, logprob)] of the prompt_logprobs most likely, best first)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # with SamplingParams.pooling: the prompt's embedding, once its prefill has run
    embedding: list[float] | None = None

    @property
    def text(self) -> str:
        """The first completion's text (the common n=1 case)."""
        return self.outputs[0].text


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (LLM.embed)."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, in vLLM's shape: `outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
