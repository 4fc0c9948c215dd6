"""Sliding-window perplexity of a text: each window is one engine request whose prompt logprobs score it.

The log-probabilities are the model runner's prompt logprobs (SamplingParams.prompt_logprobs,
flashllm/core/prompt_logprobs.py): computed during the window's prefill, chunk by chunk under
chunked prefill, on whatever backend and quantization the engine runs. No forward of its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from flashllm.eval.forward import ScoringConfig
from flashllm.eval.windows import Window, sliding_windows
from flashllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    """exp(nll_sum / num_tokens) over the scored tokens of a text."""

    perplexity: float
    nll_sum: float      # total negative log-likelihood in nats
    num_tokens: int     # scored tokens: every token of the text but the first
    num_windows: int
    max_length: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_nll": self.mean_nll}


def load_scoring_engine(config: ScoringConfig, max_length: int, chunk_tokens: int | None = None) -> Any:
    """An LLM for scoring windows of up to `max_length` tokens, one window at a time.

    Its context is max_length + 1 (the engine samples one token after each prompt; prompts must
    leave room for it) within the model's max_position_embeddings, its KV cache holds one window, and with `chunk_tokens` each step
    runs at most that many of a window's tokens (chunked prefill), else a window is one prefill.
    """
    from flashllm.config import CacheConfig
    from flashllm.llm import LLM
    from flashllm.models.hf_config import load_hf_config

    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens must be at least 1, got {chunk_tokens}")
    context = min(max_length + 1, load_hf_config(config.model).max_position_embeddings)
    return LLM(config.model, dtype=config.dtype, device=config.device, backend=config.backend,
               quant_type=config.quant_type, group_size=config.group_size, kv_cache_dtype=config.kv_cache_dtype,
               quantize_lm_head=config.quantize_lm_head or None, max_model_len=context, max_num_seqs=1,
               num_kv_blocks=math.ceil(context / CacheConfig().block_size),
               max_num_batched_tokens=chunk_tokens or context, enable_prefix_caching=False)


def window_logprobs(llm: Any, token_ids: list[int], windows: list[Window]) -> list[list[float]]:
    """Per window, the log-probabilities of its scored targets token_ids[score_from:end], fp32 values as floats.

    Each window runs as one request with prompt logprobs (no top tokens) and one greedy token,
    which is discarded; the requests queue and run one at a time (the engine's max_num_seqs).
    """
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([token_ids[w.begin:w.end] for w in windows], params)
    scored = []
    for window, output in zip(windows, outputs, strict=True):
        entries = output.prompt_logprobs
        if entries is None or len(entries) != window.end - window.begin:
            raise RuntimeError(f"the engine returned {0 if entries is None else len(entries)} prompt logprobs for a "
                               f"window of {window.end - window.begin} tokens")
        scored.append([entry[0] for entry in entries[window.score_from - window.begin:]])  # type: ignore[index]
    return scored


def perplexity(llm: Any, token_ids: list[int], max_length: int, stride: int, progress: bool = False) -> PerplexityResult:
    """Perplexity of `token_ids` with windows of `max_length` tokens moving by `stride`, scored by `llm`
    (load_scoring_engine): only the tokens each window adds (see sliding_windows) count; NLL summed in float64."""
    windows = sliding_windows(len(token_ids), max_length, stride)
    longest, context = max(w.end - w.begin for w in windows), llm.engine.max_model_len
    if longest >= context:
        raise ValueError(f"a window of {longest} tokens fills the engine's whole context ({context}, the model's "
                         f"max_position_embeddings); the engine samples one token after each window, so pass "
                         f"--max-length {context - 1} or less")
    nll_sum, num_tokens = 0.0, 0
    for window in tqdm(windows, desc="perplexity", unit="window", disable=not progress):
        (logprobs,) = window_logprobs(llm, token_ids, [window])
        nll_sum -= math.fsum(logprobs)
        num_tokens += len(logprobs)
    return PerplexityResult(math.exp(nll_sum / num_tokens), nll_sum, num_tokens, len(windows), max_length, stride)
