"""A small draft model as proposer: same vocabulary as the target, its own KV cache over the target's blocks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashllm.config import MAX_DRAFT_TOKENS, SpeculativeConfigError
from flashllm.core.model_runner import ModelRunner
from flashllm.core.runner_select import model_runner_class
from flashllm.core.sampler import SamplingState
from flashllm.core.scheduler import ScheduledSequence, SchedulerOutput
from flashllm.core.sequence import Sequence
from flashllm.core.spec.ngram import NgramProposer
from flashllm.core.spec.speculator import Target
from flashllm.models.tokenizers import TOKENIZER_FILES
from flashllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Token ids the draft's greedy vocabulary may gain past its base before it starts again from the base and the
# live sequences' tokens (a long-running server sees ever more distinct tokens; each costs a head row a step).
_VOCAB_SLACK = 8192
# After a pass whose guesses all missed, a sequence's next passes take no guesses for this many of its tokens: a
# wrong guess costs the pass a row, and text with nothing to copy misses again and again.
_GUESS_PAUSE = 16
# The most one-token rows a draft pass of the lookup's guesses runs (all sequences together): a decode-sized
# batch, which backends' decode paths take (the cpu backend's fused step takes up to 32 rows).
_PASS_ROWS = 32


@dataclass(slots=True)
class _DraftView:
    """What the draft runner reads of a sequence (ModelRunner._flatten): its tokens, how many of them
    have draft KV, and the target's block table, whose blocks the draft's cache mirrors."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    # the rest of what the runner may read of a Sequence: the draft wants no prompt logprobs and no adapter
    sampling_params: Any = None
    num_prompt_tokens: int = 0
    lora_id: int = 0
    seq_id: int = -1  # the proposer's key for its state (ModelInput.seq_ids, read by a hidden_sink only, which a
    # draft runner has none of)


@dataclass(slots=True)
class _DraftState:
    """Per sequence: the tokens the draft ran (KV written) and the block table they were written under."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    seen: int = 0  # how many of the sequence's tokens the greedy vocabulary was given
    guess_from: int = 0  # no lookup guesses before the sequence has this many tokens (after guesses that all missed)


class DraftModelProposer:
    """Drafts greedily with a small model of the same vocabulary.

    Its KV cache has as many blocks as the target's, indexed by the target's block tables, so no block
    bookkeeping of its own: a round first catches the draft up on the tokens it has not run (the prompt
    the first time, then the accepted tokens and the target's own token), then runs k - 1 one-token steps.
    What the draft computed stays valid while its tokens are a prefix of the sequence's and the blocks
    they sit in are unchanged (a preempted sequence comes back in other blocks and is caught up again).
    Drafts only ever change how many tokens a round yields, never which: the target verifies them all.

    With a lookup (the n-gram proposer over the sequence and its drafts so far), the draft's steps run as
    the target's verify step does: a pass takes the lookup's guesses at the draft's next tokens as extra
    one-token rows, and each guess equal to the draft's own token before it gives the draft's next token
    from the same pass. The drafts are the draft's greedy chain either way (the lookup never adds a token
    the draft did not choose); where the guesses hold, as in a copy, k drafts cost one pass instead of k.
    """

    def __init__(self, runner: ModelRunner, target_vocab_size: int, draft_vocab: int = 0,
                 lookup: NgramProposer | None = None) -> None:
        self.runner = runner
        # guesses at the draft's own next tokens (SpeculativeConfig.draft_lookup): a pass checks them all at once
        self.lookup = lookup
        self.block_size = runner.block_size
        self.target_vocab_size = target_vocab_size
        self._states: dict[int, _DraftState] = {}
        # The draft's greedy vocabulary (draft_vocab > 0): ids below draft_vocab, which a BPE vocabulary gives
        # its bytes and most frequent merges, plus every token of the sequences drafted for, which is what a copy
        # repeats. A runner that cannot restrict its head (restrict_greedy_vocabulary False) keeps the whole
        # vocabulary. The drafts differ, never the tokens: the target verifies them.
        self._vocab_base = min(draft_vocab, target_vocab_size)
        self._vocab: list[int] = list(range(self._vocab_base))
        self._in_vocab = set(self._vocab)
        self.restricted = bool(self._vocab_base) and runner.restrict_greedy_vocabulary(self._vocab)
        # what the runner's multi-step decode reads of each row: plain greedy, no stop token ends a draft
        self._greedy_state = SamplingState(SamplingParams(temperature=0.0, ignore_eos=True), None, ())

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy draft tokens for each sequence (their block tables must already cover
        num_tokens - 1 + limits[i] positions)."""
        views = [self._catch_up_view(seq) for seq in seqs]
        if self.restricted:
            self._grow_vocabulary(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        guesses = self._guesses(views, active, drafts, limits)
        runs = self._catch_up(views, guesses)  # each sequence's first drafts
        while True:
            for i, run in zip(active, runs, strict=True):
                drafts[i].extend(run)
                view = views[i]  # the run's tokens but its last have draft KV now
                view.num_computed_tokens = len(view.token_ids) + len(run) - 1
                view.token_ids.extend(run)
            # a token past the target's vocabulary ends that draft (the target could never accept it)
            active = [i for i in active if len(drafts[i]) < limits[i] and drafts[i][-1] < self.target_vocab_size]
            if not active:
                break
            guesses = self._guesses(views, active, drafts, limits)
            if any(guesses):
                runs = self._rows([views[i] for i in active], guesses)
            else:
                steps = self._decode(views, active, min(limits[i] - len(drafts[i]) for i in active))
                runs = [list(tokens) for tokens in zip(*steps, strict=True)]
        for seq, view in zip(seqs, views, strict=True):
            self._remember(seq, view.token_ids[:view.num_computed_tokens])
        return [_in_vocabulary(draft[:limit], self.target_vocab_size) for draft, limit in zip(drafts, limits,
                                                                                            strict=True)]

    def _guesses(self, views: list[_DraftView], active: list[int], drafts: list[list[int]],
                 limits: list[int]) -> list[list[int]]:
        """For each active sequence, the lookup's guess at the draft's next tokens after the one it drafts
        from the view's last token (no more than its limit leaves room for); [] each without a lookup."""
        if self.lookup is None:
            return [[] for _ in active]
        guesses, rows = [], 0
        for i in active:
            view = views[i]
            rows += len(view.token_ids) - view.num_computed_tokens
            room = min(limits[i] - len(drafts[i]) - 1, _PASS_ROWS - rows)
            if len(view.token_ids) < self._states[view.seq_id].guess_from:
                room = 0
            guess = self.lookup.propose(view.token_ids, room) if room > 0 else []
            rows += len(guess)
            guesses.append(guess)
        return guesses

    def _rows(self, views: list[_DraftView], guesses: list[list[int]]) -> list[list[int]]:
        """One pass over each view's tokens without draft KV, then its guesses, as one-token rows (the verify
        step's shape, ModelRunner._flatten_drafted, which a backend's decode paths take). Each view's run: the
        greedy token after its last token, then, while each guess equals the token before it in the run, the
        greedy token after that guess: the draft's own greedy chain, whichever tokens were guessed."""
        batch = SchedulerOutput([ScheduledSequence(v, 1, True, v.token_ids[v.num_computed_tokens + 1:] + guess)  # type: ignore[arg-type]
                                 for v, guess in zip(views, guesses, strict=True)])
        rows = self._greedy(batch)
        runs, end = [], 0
        for view, guess in zip(views, guesses, strict=True):
            end += len(view.token_ids) - view.num_computed_tokens + len(guess)
            run = [rows[end - len(guess) - 1]]
            for guessed, after in zip(guess, rows[end - len(guess):end], strict=True):
                if guessed != run[-1]:
                    break
                run.append(after)
            if guess and len(run) == 1:  # every guess missed: none for a while
                self._states[view.seq_id].guess_from = len(view.token_ids) + _GUESS_PAUSE
            runs.append(run)
        return runs

    def prefill(self, seqs: list[Sequence], ends: list[int]) -> None:
        """Run the draft over each sequence's tokens before ends[i], the prefill chunk the target just ran
        (before its first token is recorded, so the draft's prompt pass is timed as prefill, not as decode):
        the sequence's first round then catches the draft up on the sampled token only."""
        views, kept = [], []
        for seq, end in zip(seqs, ends, strict=True):
            view = self._catch_up_view(seq)
            if end > view.num_computed_tokens:
                view.token_ids = view.token_ids[:end]
                views.append(view)
                kept.append(seq)
        if not views:
            return
        self.runner.execute_model(SchedulerOutput([ScheduledSequence(v, len(v.token_ids) - v.num_computed_tokens,  # type: ignore[arg-type]
                                                                     False) for v in views]))
        for seq, view in zip(kept, views, strict=True):
            self._remember(seq, view.token_ids)

    def _decode(self, views: list[_DraftView], active: list[int], steps: int) -> list[list[int]]:
        """Up to `steps` greedy one-token steps of the active sequences: [step][active sequence]. A runner
        that decodes several steps in one call (the cpu backend's native multi-step decode) runs them
        so; the generic runner gives one step per call."""
        batch = SchedulerOutput([ScheduledSequence(views[i], 1, True) for i in active])  # type: ignore[arg-type]
        states = [self._greedy_state] * len(active)
        if steps > 1 and self.runner.max_tokens_per_step(states) > 1:
            outputs = self.runner.execute(batch, states, min(steps, self.runner.max_tokens_per_step(states)))
            return [[int(t) for t in out.token_ids] for out in outputs]  # type: ignore[arg-type]
        return [self._greedy(batch)]

    def _catch_up(self, views: list[_DraftView], guesses: list[list[int]]) -> list[list[int]]:
        """Run each view's tokens that have no draft KV yet; each view's run of drafts (see _rows).

        After the first round a sequence brings only the round's accepted drafts and the target's token
        (at most k + 1), which run as one-token rows over its block table, with the lookup's guesses after
        them (_rows), so a backend's decode paths take them (on the cpu backend the fused native step, ~5x
        faster there than the layer-by-layer forward of a short chunk). A batch with a longer catch-up
        (a prompt, a preempted sequence) runs as one chunk per sequence, without guesses."""
        counts = [len(v.token_ids) - v.num_computed_tokens for v in views]
        if max(counts) > 1 + MAX_DRAFT_TOKENS:
            batch = SchedulerOutput([ScheduledSequence(v, n, True)  # type: ignore[arg-type]
                                     for v, n in zip(views, counts, strict=True)])
            return [[token] for token in self._greedy(batch)]
        return self._rows(views, guesses)

    def _catch_up_view(self, seq: Sequence) -> _DraftView:
        """The sequence as the draft sees it: tokens up to the first one whose draft KV is not valid."""
        state = self._states.setdefault(seq.seq_id, _DraftState())
        valid = 0
        limit = min(len(state.tokens), seq.num_tokens - 1)  # at least the last token runs, to draft from it
        while valid < limit and state.tokens[valid] == seq.token_ids[valid]:
            valid += 1
        block = 0
        while block * self.block_size < valid and block < len(state.blocks) and block < len(seq.block_table) \
                and state.blocks[block] == seq.block_table[block]:
            block += 1
        valid = min(valid, block * self.block_size)
        return _DraftView(list(seq.token_ids), valid, seq.block_table, seq_id=seq.seq_id)

    def _grow_vocabulary(self, seqs: list[Sequence]) -> None:
        """Add these sequences' tokens the greedy vocabulary does not have yet. Past _VOCAB_SLACK added ids it
        starts again from the base ids, these sequences' tokens and what the draft ran of every other one."""
        added = False
        for seq in seqs:
            state = self._states[seq.seq_id]
            for token in seq.token_ids[state.seen:]:
                if token not in self._in_vocab and 0 <= token < self.target_vocab_size:
                    self._in_vocab.add(token)
                    self._vocab.append(token)
                    added = True
            state.seen = seq.num_tokens
        if not added:
            return
        if len(self._vocab) > self._vocab_base + _VOCAB_SLACK:
            drafted = {seq.seq_id for seq in seqs}
            others = [state for key, state in self._states.items() if key not in drafted]
            for state in others:  # what they brought past the tokens the draft ran comes again next time
                state.seen = min(state.seen, len(state.tokens))
            self._vocab = list(range(self._vocab_base))
            self._in_vocab = set(self._vocab)
            for tokens in [seq.token_ids for seq in seqs] + [state.tokens for state in others]:
                for token in tokens:
                    if token not in self._in_vocab and 0 <= token < self.target_vocab_size:
                        self._in_vocab.add(token)
                        self._vocab.append(token)
        self.runner.restrict_greedy_vocabulary(self._vocab)

    def _remember(self, seq: Sequence, tokens: list[int]) -> None:
        """The draft's KV now holds `tokens` of this sequence, in its current blocks."""
        state = self._states[seq.seq_id]
        state.tokens, state.blocks = tokens, list(seq.block_table)

    def _greedy(self, batch: SchedulerOutput) -> list[int]:
        return self.runner.execute_model(batch, greedy=True).tolist()

    def measure_drafts(self, seq: Sequence, drafts: int, timer: Callable[[Callable[[], object]], float]) -> float:
        """timer's seconds for proposing `drafts` drafts after the sequence's last token where the lookup guesses
        nothing (a text with nothing to copy, where the guard's judgement matters): the last token's catch-up
        row, then the draft's steps. The sequence's block table must cover its drafts; the draft's KV of its
        earlier tokens is computed first, untimed, and the proposer keeps nothing of it after."""
        lookup, self.lookup = self.lookup, None
        try:
            self.prefill([seq], [seq.num_tokens - 1])  # the prompt's draft KV, as a prefill step runs it
            return timer(lambda: self.propose([seq], [drafts]))
        finally:
            self.lookup = lookup
            self.forget(seq)

    def forget(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def kv_cache_bytes(self) -> int:
        """Bytes of the draft's KV cache."""
        return self.runner.kv_cache_bytes()


def _in_vocabulary(draft: list[int], vocab_size: int) -> list[int]:
    """The draft up to its first token outside the target's vocabulary."""
    for i, token in enumerate(draft):
        if token >= vocab_size:
            return draft[:i]
    return draft


@dataclass(slots=True)
class _LoadedDraft:
    """The draft model's weights, loaded; its runner (and KV cache) comes once the target's blocks are counted."""

    model: Any
    runner_cls: type[ModelRunner]
    target: Target
    dtype: Any
    kv_bytes_per_block: int

    def proposer(self, runner: ModelRunner, num_blocks: int) -> DraftModelProposer:
        selection, block_size = self.target.selection, self.target.config.cache.block_size
        draft_runner = self.runner_cls(self.model, selection.device, num_blocks, block_size, self.dtype,
                                       adapter=selection.adapter)
        logger.info("draft model %s: KV cache of %d blocks, %.2f GiB beside the target's",
                    self.target.config.speculative.model, num_blocks, draft_runner.kv_cache_bytes() / 2**30)
        spec = self.target.config.speculative
        lookup = NgramProposer(spec.max_ngram_size, spec.max_ngram_size) if spec.draft_lookup else None
        return DraftModelProposer(draft_runner, self.target.hf_config.vocab_size, spec.draft_vocab, lookup)


def load_draft_model(target: Target) -> _LoadedDraft:
    """Load --speculative-model on the target's device and backend (its KV cache comes later, sized with the
    target's); ValueError (one line) when its vocabulary is not the target's."""
    from flashllm.models.hf_config import kernel_request, load_hf_config
    from flashllm.models.loader import load_model, resolve_dtype
    from flashllm.models.registry import ModelRegistry
    from flashllm.quant.spec import weight_quant_spec
    from flashllm.registry.backend import OpRequest
    from flashllm.registry.plugins import make_plugin_manager
    from flashllm.registry.resolve import resolve_ops

    config, model_dir = target.config, Path(str(target.config.speculative.model))
    plugins = make_plugin_manager()
    registry = ModelRegistry()
    for architecture, model_target in plugins.model_targets().items():
        registry.register(architecture, model_target)
    hf_config = load_hf_config(model_dir, registry)
    _check_vocabulary(target, model_dir, hf_config.vocab_size)
    selection = target.selection
    dtype = resolve_dtype(config.model.dtype, hf_config.torch_dtype, selection.profile.native_bf16,
                          selection.profile.accelerator)
    quant = weight_quant_spec(config.speculative.quant_type, config.speculative.group_size, False)
    request = OpRequest(dtype, dtype, quant.scheme, hf_config.head_dim, config.cache.block_size,
                        **kernel_request(hf_config))
    ops = resolve_ops(selection, request, plugins=plugins, strict=config.device.strict_kernels)
    model, hf_config = load_model(model_dir, ops, dtype, selection.device, registry, progress=False, quant=quant)
    runner_cls = model_runner_class(selection)
    runner_cls.prepare_model(model, selection.adapter)
    per_block = runner_cls.kv_bytes_per_block(model, config.cache.block_size, dtype)
    return _LoadedDraft(model, runner_cls, target, dtype, per_block)


def _check_vocabulary(target: Target, model_dir: Path, draft_vocab_size: int) -> None:
    """The draft must speak the target's tokens: equal tokenizer vocabularies where both have a tokenizer,
    else equal vocab_size."""
    if target.tokenizer is not None and any((model_dir / name).exists() for name in TOKENIZER_FILES):
        from flashllm.models.tokenizer import load_tokenizer

        if load_tokenizer(str(model_dir)).get_vocab() != target.tokenizer.get_vocab():
            raise SpeculativeConfigError(f"the draft model {model_dir} has another vocabulary than the target "
                                         f"{target.model_dir}: speculative decoding needs a draft with the same "
                                         "tokenizer")
        return
    if draft_vocab_size != target.hf_config.vocab_size:
        raise SpeculativeConfigError(f"the draft model {model_dir} has vocab_size {draft_vocab_size}, the target "
                                     f"{target.hf_config.vocab_size}: speculative decoding needs a draft with the "
                                     "same vocabulary")
