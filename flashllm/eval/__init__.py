"""Accuracy evaluation: sliding-window perplexity, ROUGE of generated text, KL divergence between configurations."""

from __future__ import annotations

from flashllm.eval.forward import ScoringConfig, load_scoring_parts, window_hidden
from flashllm.eval.kl import KLResult, compare_configs, kl_per_position
from flashllm.eval.perplexity import PerplexityResult, perplexity
from flashllm.eval.rouge import ROUGE_TYPES, RougeScores, rouge_scores, tokenize
from flashllm.eval.windows import Window, sliding_windows

__all__ = [
    "ROUGE_TYPES",
    "KLResult",
    "PerplexityResult",
    "RougeScores",
    "ScoringConfig",
    "Window",
    "compare_configs",
    "kl_per_position",
    "load_scoring_parts",
    "perplexity",
    "rouge_scores",
    "sliding_windows",
    "tokenize",
    "window_hidden",
]
