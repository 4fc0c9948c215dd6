"""KL divergence and top-1 agreement of next-token distributions between two engine configurations."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from flashllm.core.builder import EngineParts
from flashllm.eval.forward import iter_logprobs, window_hidden
from flashllm.eval.windows import sliding_windows


@dataclass(frozen=True, slots=True)
class KLResult:
    """KL(baseline || candidate) per position, summarised over every scored position of a text."""

    mean_kl: float
    max_kl: float
    top1_agreement: float          # share of positions where both configurations' argmax agree
    relative_logit_error: float    # ||l_cand - l_base|| / ||l_base|| over all positions, logits centred per row
    baseline_perplexity: float
    candidate_perplexity: float
    num_positions: int
    num_windows: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kl_per_position(base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(P_base || P_cand) of each row: (N, V) fp32 log-probs twice -> (N,) fp32 nats.

    sum_v p_base(v) * (log p_base(v) - log p_cand(v)); a token the baseline gives probability 0
    contributes 0, one the candidate gives probability 0 while the baseline does not gives inf.
    """
    if base_logprobs.shape != cand_logprobs.shape:
        raise ValueError(f"log-prob shapes differ: baseline {tuple(base_logprobs.shape)} vs candidate "
                         f"{tuple(cand_logprobs.shape)}; both configurations must share the vocabulary")
    base_probs = base_logprobs.exp()
    terms = torch.where(base_probs > 0, base_probs * (base_logprobs - cand_logprobs), 0.0)
    return terms.sum(dim=-1)


def compare_logprobs(base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL per row (N,) fp32, top-1 agreement per row (N,) bool) of two (N, V) log-prob sets."""
    kl = kl_per_position(base_logprobs, cand_logprobs)
    agree = base_logprobs.argmax(dim=-1) == cand_logprobs.argmax(dim=-1)
    return kl, agree


def centred(logprobs: torch.Tensor) -> torch.Tensor:
    """(N, V) log-probs minus each row's mean: the logits up to softmax's free per-row shift, centred."""
    return logprobs - logprobs.mean(dim=-1, keepdim=True)


def compare_configs(baseline: EngineParts, candidate: EngineParts, token_ids: list[int], max_length: int,
                    stride: int, progress: bool = False, chunk_tokens: int | None = None) -> KLResult:
    """Run both configurations over the same sliding windows and compare their next-token distributions.

    Positions are the ones sliding-window perplexity scores (every token but the first, each
    once), so the two perplexities come for free from the same log-probs. chunk_tokens: run the
    windows as chunked prefill steps of that many tokens (window_hidden).
    """
    windows = sliding_windows(len(token_ids), max_length, stride)
    kl_sum = kl_max = 0.0
    agree = count = 0
    err_sq = ref_sq = 0.0  # squared norms of the centred-logit difference and of the baseline's centred logits
    nll = [0.0, 0.0]
    for window in tqdm(windows, desc="kl", unit="window", disable=not progress):
        ids = token_ids[window.begin:window.end]
        rows = torch.tensor(list(window.logit_rows()), dtype=torch.int64)
        targets = torch.tensor(token_ids[window.score_from:window.end], dtype=torch.int64)
        pairs = zip(iter_logprobs(baseline, window_hidden(baseline, ids, chunk_tokens), rows),
                    iter_logprobs(candidate, window_hidden(candidate, ids, chunk_tokens), rows), strict=True)
        for (chunk, base), (_, cand) in pairs:
            cand = cand.to(base.device)
            kl, same = compare_logprobs(base, cand)
            kl_sum += float(kl.double().sum())
            kl_max = max(kl_max, float(kl.max()))
            agree += int(same.sum())
            count += kl.numel()
            base_c, cand_c = centred(base.double()), centred(cand.double())
            err_sq += float((cand_c - base_c).square().sum())
            ref_sq += float(base_c.square().sum())
            chunk_targets = targets[chunk - rows[0]].to(base.device).unsqueeze(1)
            nll[0] -= float(base.gather(1, chunk_targets).double().sum())
            nll[1] -= float(cand.gather(1, chunk_targets).double().sum())
    return KLResult(kl_sum / count, kl_max, agree / count, math.sqrt(err_sq / ref_sq), math.exp(nll[0] / count), math.exp(nll[1] / count),
                    count, len(windows))
