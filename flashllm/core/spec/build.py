"""Builds the engine's Speculator from SpeculativeConfig: the proposer, checked against the target model."""

from __future__ import annotations

import logging

from flashllm.config import SPECULATE_METHODS, EngineConfig
from flashllm.core.block_manager import BlockManager
from flashllm.core.builder import EngineParts
from flashllm.core.spec.speculator import NgramDrafts, Proposer, Speculator

logger = logging.getLogger(__name__)


def make_speculator(config: EngineConfig, parts: EngineParts, block_manager: BlockManager) -> Speculator | None:
    """None when speculation is off; otherwise the Speculator over the configured proposer.
    ValueError, before anything runs, for an unknown method or a draft model that does not fit."""
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method not in SPECULATE_METHODS:
        raise ValueError(f"--speculate_method {spec.method!r} is not one of {', '.join(SPECULATE_METHODS)}")
    proposer: Proposer
    if spec.method in ("ngram", "inference_with_reference"):
        proposer = NgramDrafts(spec.max_ngram_size, spec.min_ngram_size)
    elif spec.method == "mtp":
        from flashllm.core.spec.mtp import MTPProposer

        proposer = MTPProposer.build(config, parts, block_manager)
    else:
        from flashllm.core.spec.draft_model import DraftModelProposer

        proposer = DraftModelProposer.build(config, parts, block_manager)
    speculator = Speculator(spec, proposer, block_manager, int(config.model.max_model_len or 0))
    logger.info("speculative decoding: %s, up to %d drafts per round", spec.method, spec.num_speculative_tokens)
    return speculator
