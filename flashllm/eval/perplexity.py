"""Sliding-window perplexity of a text under a model loaded by the engine."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from flashllm.core.builder import EngineParts
from flashllm.eval.forward import iter_logprobs, window_hidden
from flashllm.eval.windows import Window, sliding_windows


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


def target_logprobs(parts: EngineParts, token_ids: list[int], window: Window,
                    chunk_tokens: int | None = None) -> torch.Tensor:
    """Log-probabilities (num_scored,) fp32 of the window's scored targets given their context
    (chunk_tokens: the window as chunked prefill steps, see window_hidden)."""
    hidden = window_hidden(parts, token_ids[window.begin:window.end], chunk_tokens)
    rows = torch.tensor(list(window.logit_rows()), dtype=torch.int64)
    targets = torch.tensor(token_ids[window.score_from:window.end], dtype=torch.int64)
    picked = []
    for chunk, logprobs in iter_logprobs(parts, hidden, rows):
        # row r predicts the token right after it: window position r + 1
        chunk_targets = targets[chunk - rows[0]].to(logprobs.device)
        picked.append(logprobs.gather(1, chunk_targets.unsqueeze(1)).squeeze(1).cpu())
    return torch.cat(picked)


def perplexity(parts: EngineParts, token_ids: list[int], max_length: int, stride: int,
               progress: bool = False, chunk_tokens: int | None = None) -> PerplexityResult:
    """Perplexity of `token_ids` with windows of `max_length` tokens moving by `stride`.

    Each window is one prefill forward through the engine's model; only the tokens it adds
    (see sliding_windows) are scored. NLL is summed in float64.
    """
    windows = sliding_windows(len(token_ids), max_length, stride)
    nll_sum, num_tokens = 0.0, 0
    for window in tqdm(windows, desc="perplexity", unit="window", disable=not progress):
        logprobs = target_logprobs(parts, token_ids, window, chunk_tokens)
        nll_sum -= float(logprobs.double().sum())
        num_tokens += logprobs.numel()
    return PerplexityResult(math.exp(nll_sum / num_tokens), nll_sum, num_tokens, len(windows), max_length, stride)
