"""Builds the engine's Speculator from SpeculativeConfig: checks, the drafter's weights, then the proposer."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from flashllm.config import MAX_DRAFT_TOKENS, SPECULATE_METHODS, EngineConfig, SpeculativeConfigError
from flashllm.core.block_manager import BlockManager
from flashllm.core.spec.ngram import NgramProposer
from flashllm.core.spec.speculator import Drafter, NgramDrafts, Proposer, Speculator, Target

logger = logging.getLogger(__name__)

# methods that load weights beside the target (a draft model, a head), with a KV cache of their own
_LOADED_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# of those, the heads that read the target's hidden states (and share its embedding or LM head). Every drafter
# runs whole on the driver (rank 0) beside its shard of the target: a draft model as a one-rank model of its own,
# a head on the driver's hidden states (whole on every rank) and whole copies of the target's vocabulary tables
_HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp")


def check_speculative_config(config: EngineConfig) -> None:
    """What SpeculativeConfig alone can tell, before any model loads or rank starts: SpeculativeConfigError
    (one line) for an unknown method, a draft count outside 1..MAX_DRAFT_TOKENS, bad n-gram sizes or guard,
    or a missing --speculative-model."""
    spec = config.speculative
    if not spec.enabled:
        return
    if spec.method not in SPECULATE_METHODS:
        raise SpeculativeConfigError(f"--speculate_method {spec.method!r} is not one of "
                                     f"{', '.join(SPECULATE_METHODS)}")
    count = spec.num_speculative_tokens
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DRAFT_TOKENS:
        raise SpeculativeConfigError(f"--speculate_max_draft_token_num must be an integer in 1..{MAX_DRAFT_TOKENS}, "
                                     f"got {count!r}")
    if spec.min_acceptance is not None and not 0.0 <= spec.min_acceptance < 1.0:
        raise SpeculativeConfigError(f"the speculation guard's min_acceptance must be in [0, 1), "
                                     f"got {spec.min_acceptance}")
    vocab = spec.draft_vocab
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
        raise SpeculativeConfigError(f"--speculative_draft_vocab must be a whole number >= 0 (0: the draft's whole "
                                     f"vocabulary), got {vocab!r}")
    if not isinstance(spec.draft_lookup, bool):
        raise SpeculativeConfigError(f"--speculative_draft_lookup must be 1 or 0 (true or false), "
                                     f"got {spec.draft_lookup!r}")
    if spec.method in ("ngram", "inference_with_reference") or (spec.method == "draft_model" and spec.draft_lookup):
        try:
            NgramProposer(spec.max_ngram_size, spec.min_ngram_size)
        except ValueError as exc:  # bad sizes
            raise SpeculativeConfigError(str(exc)) from None
    if spec.method in ("draft_model", "eagle", "eagle3") and not spec.model:
        what = "the draft's" if spec.method == "draft_model" else "the EAGLE head's"
        raise SpeculativeConfigError(f"--speculate_method {spec.method} needs {what} directory: pass "
                                     "--speculative-model DIR")


def load_drafter(target: Target, rank: int = 0) -> Drafter | None:
    """The configured drafter's weights, loaded beside the target before its KV cache is sized (None for the
    n-gram lookup, which keeps no weights or cache, and on tensor-parallel ranks other than the driver: only
    the driver's engine drafts). Every rank calls it: for a head under tensor parallelism each sends the driver
    its rows of the target's embedding or LM head where the head reads them. SpeculativeConfigError (one
    line) for a drafter that does not fit the target (another vocabulary, another hidden size, no MTP layer)."""
    spec = target.config.speculative
    check_speculative_config(target.config)
    if not spec.enabled or spec.method not in _LOADED_METHODS:
        return None
    if spec.method in _HIDDEN_STATE_METHODS:
        target = replace(target, vocabulary=_whole_vocabulary(target))
    if rank != 0:
        return None
    if spec.method == "mtp":
        from flashllm.core.spec.mtp import load_mtp_drafter

        return load_mtp_drafter(target)
    if spec.method in ("eagle", "eagle3"):
        from flashllm.core.spec.eagle import load_eagle_drafter

        return load_eagle_drafter(target)
    from flashllm.core.spec.draft_model import load_draft_model

    return load_draft_model(target)


def _whole_vocabulary(target: Target) -> Any:
    """Whole copies on the driver of those of a tensor-parallel target's embedding and LM head the head reads
    (None where the target is not split, or has no such modules, or the head reads neither: its loader then
    uses or refuses the target's own). The driver reads which from the head's files and tells the other ranks,
    which need no copy of them."""
    import torch

    from flashllm.core.parallel import control_group
    from flashllm.models.layers.embedding import LMHead, VocabEmbedding, gather_whole_vocabulary, target_vocabulary

    embed, head = target_vocabulary(target.model)
    if not isinstance(embed, VocabEmbedding) or not isinstance(head, LMHead) or embed.tp_size == head.tp_size == 1:
        return None
    wanted = torch.tensor(_reads_from_target(target) if embed.tp_rank == 0 else (False, False), dtype=torch.int64)
    torch.distributed.broadcast(wanted, src=0, group=control_group())
    want_embed, want_head = (bool(x) for x in wanted.tolist())
    if not (want_embed or want_head):
        return None
    return gather_whole_vocabulary(embed, head, target.ops, (want_embed, want_head))


def _reads_from_target(target: Target) -> tuple[bool, bool]:
    """Which of the target's (embedding, LM head) the configured head reads; neither where its files cannot be
    read (its loader then says why, in one line)."""
    from flashllm.models import eagle, mtp_loading
    from flashllm.models.hf_config import ModelLoadError

    spec = target.config.speculative
    try:
        if spec.method == "mtp":
            return mtp_loading.reads_from_target(target.model_dir, target.model.config)
        return eagle.reads_from_target(str(spec.model))
    except (ModelLoadError, OSError, ValueError, AttributeError):  # AttributeError: a config without layers
        return False, False


def make_speculator(config: EngineConfig, drafter: Drafter | None, runner: Any,
                    block_manager: BlockManager) -> Speculator | None:
    """None when speculation is off; otherwise the Speculator over the configured proposer, whose cache (if
    any) gets as many blocks as the target's: `drafter` (load_drafter's, the engine parts' `drafter`) was
    loaded before they were counted; `runner` is the target's ModelRunner."""
    spec = config.speculative
    if not spec.enabled:
        return None
    check_speculative_config(config)
    proposer: Proposer
    if spec.method in ("ngram", "inference_with_reference"):
        proposer = NgramDrafts(spec.max_ngram_size, spec.min_ngram_size)
    elif drafter is None:
        raise ValueError(f"--speculate_method {spec.method}: the engine parts were built without its drafter")
    else:
        proposer = drafter.proposer(runner, block_manager.num_total_blocks)
    speculator = Speculator(spec, proposer, block_manager, int(config.model.max_model_len or 0),
                            bursts_feed_drafter=getattr(runner, "bursts_feed_hidden_sink", False))
    logger.info("speculative decoding: %s, up to %d drafts per round", spec.method, spec.num_speculative_tokens)
    return speculator


def calibrate_guard(engine: Any) -> None:
    """For a proposer whose drafts cost time (measure_drafts: a draft model, an MTP layer, an EAGLE head),
    measure a round against plain decoding on this machine (core/spec/costs.py) and let the guard judge
    acceptance against its break-even point, unless SpeculativeConfig.min_acceptance was given."""
    speculator = engine.speculator
    if speculator is None or speculator.config.min_acceptance is not None \
            or not hasattr(speculator.proposer, "measure_drafts"):
        return
    from flashllm.core.spec.costs import measure_round

    # the fastest of 5 repeats: other work on the host only ever adds to a step's time
    costs = measure_round(engine, speculator.config.num_speculative_tokens, repeats=5, proposer=speculator.proposer,
                          summary=min)
    if costs is not None:
        speculator.set_break_even(costs)
