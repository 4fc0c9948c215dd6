"""A checkpoint's multi-token prediction layer (DeepSeek-V3, GLM-4.5) as proposer: drafts from the target's own final
hidden states."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from flashllm.config import SpeculativeConfigError
from flashllm.core.model_runner import ModelInput, ModelRunner, allocate_kv_caches
from flashllm.core.sequence import Sequence
from flashllm.core.spec.speculator import Target
from flashllm.ops.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """One sequence's target hidden states the MTP layer has not consumed: rows for positions base, base + 1, ...
    The MTP layer's cache holds valid entries (computed from the target's hidden states) below `base`."""

    base: int
    chunks: list[Tensor] = field(default_factory=list)
    count: int = 0

    def add(self, first: int, hidden: Tensor) -> None:
        """The target computed positions first.. (hidden (n, H)): they replace what was recorded from there on."""
        end = self.base + self.count
        if first < self.base or first > end:
            # recomputed from an earlier position (preemption), or positions ran where nothing was recorded
            # (a multi-step call that hands no hidden states over): the MTP layer resumes at `first`; its
            # entries in between keep older values, which can lower acceptance but never change a verified token
            self.base, self.chunks, self.count = first, [], 0
        elif first < end:  # rows of rejected drafts: the target scored these positions again
            self.chunks, self.count = [torch.cat(self.chunks)[: first - self.base]], first - self.base
        self.chunks.append(hidden)
        self.count += hidden.shape[0]

    def take(self, end: int) -> Tensor:
        """Rows for positions base..end - 1 (the caller checked they are here); afterwards base = end."""
        rows = torch.cat(self.chunks)[: end - self.base] if len(self.chunks) != 1 else self.chunks[0][: end - self.base]
        self.base, self.chunks, self.count = end, [], 0
        return rows


class MTPProposer:
    """Drafts greedily with the checkpoint's MTP layer (or an EAGLE head), reused for every draft after the first.

    The target runner hands over each step's final hidden states (ModelRunner.hidden_sink). A round for a
    sequence of tokens t_0..t_n (t_n not yet run by the target) first runs the MTP layer over every position
    i < n it has not run, from (h_i, t_{i+1}); its output at n - 1 gives draft d_1 (for t_{n+1}). Each further
    draft d_j runs the layer once more at position n + j - 2 from (its previous output, d_{j-1}), the output
    standing in for the target's hidden state. Those entries are scratch: the next round recomputes from
    the target's own hidden states. The layer's latent cache has as many blocks as the target's and is
    indexed by the target's block tables, so no block bookkeeping of its own. Drafts only change how many
    tokens a round yields, never which: the target verifies them all.
    """

    reads_hidden_states = True  # steps must feed record (see Speculator.burst_steps)

    def __init__(self, mtp: Any, runner: ModelRunner, num_blocks: int, target_vocab_size: int) -> None:
        self.mtp = mtp
        self.device = runner.device
        self.block_size = runner.block_size
        self.target_vocab_size = target_vocab_size
        dtype = next(mtp.parameters()).dtype
        # the layer's own cache (a latent one for MTP, K and V for an EAGLE head), indexed by the target's blocks
        self.kv_caches = allocate_kv_caches(mtp, self.device, num_blocks, self.block_size, dtype)
        self.adapter = runner.adapter
        # what the layer reads per target position: the final hidden states as handed over, or (EAGLE-3) its
        # target_features of them; and its draft ids' target ids, where its vocabulary is its own
        self.features = getattr(mtp, "target_features", None)
        self.token_map: Tensor | None = getattr(mtp, "draft_to_target", None)
        # its greedy drafts without its logits where the runner can (the cpu backend screens the head)
        self._head_norm, head = mtp.drafting_head()
        self._screened = runner.greedy_head(head)
        self._pending: dict[int, _Pending] = {}
        runner.hidden_sink = self.record

    def kv_cache_bytes(self) -> int:
        """Bytes of the layer's own cache."""
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

    def record(self, inputs: ModelInput, hidden: Tensor) -> None:
        """The target's step: keep each sequence's final hidden states (hidden (T, H)) by position."""
        seq_ids = inputs.seq_ids
        if not seq_ids:
            return
        if self.features is not None:
            hidden = self.features(hidden)
        bounds = inputs.attn_metadata.cu_seqlens_q[: len(seq_ids) + 1].tolist()
        starts = inputs.positions[bounds[:-1]].tolist()
        entry = 0
        while entry < len(seq_ids):
            last = entry  # a drafted decode comes as consecutive one-token entries of one sequence
            while last + 1 < len(seq_ids) and seq_ids[last + 1] == seq_ids[entry]:
                last += 1
            rows = hidden[bounds[entry]:bounds[last + 1]].clone()  # the runner may reuse its output buffer
            pending = self._pending.get(seq_ids[entry])
            if pending is None:
                # a prefix-cache hit starts past 0: the hit's MTP entries are the ones its writer left
                pending = self._pending[seq_ids[entry]] = _Pending(starts[entry])
            pending.add(starts[entry], rows)
            entry = last + 1

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy drafts for each sequence (block tables covering num_tokens - 1 + limits[i]
        positions); none for a sequence whose latest hidden state the target did not hand over."""
        drafts: list[list[int]] = [[] for _ in seqs]
        ready, rows, hidden = [], [], []
        for i, seq in enumerate(seqs):
            last = seq.num_tokens - 1  # t_last has no target hidden state yet; h_{last-1} drafts t_{last+1}
            pending = self._pending.get(seq.seq_id)
            if pending is None or not pending.base < last <= pending.base + pending.count:
                if pending is not None:
                    pending.base, pending.chunks, pending.count = last, [], 0
                continue
            start = pending.base
            ready.append(i)
            rows.append((seq, start, last))
            hidden.append(pending.take(last))
        if not ready:
            return drafts
        with self.adapter.inference_mode():
            # catch up: positions start..last-1 from (h_p, t_{p+1}); the output at last - 1 drafts t_{last+1}
            ids = [t for seq, start, last in rows for t in seq.token_ids[start + 1:last + 1]]
            positions = [p for _, start, last in rows for p in range(start, last)]
            out = self._run(ids, positions, torch.cat(hidden), [seq for seq, _, _ in rows],
                            [last - start for _, start, last in rows], [last for _, _, last in rows])
            ends = list(accumulate(last - start for _, start, last in rows))
            states = out[torch.tensor(ends, device=out.device) - 1]
            tokens = self._greedy(states)
            active = list(range(len(ready)))
            for step in range(1, max(limits[i] for i in ready) + 1):
                for n, token in zip(active, tokens, strict=True):
                    drafts[ready[n]].append(token)
                keep = [k for k, n in enumerate(active) if len(drafts[ready[n]]) < limits[ready[n]]]
                if not keep:
                    break
                active = [active[k] for k in keep]
                # draft step + 1: position last + step - 1 from (the layer's previous output, the latest draft)
                states = states[torch.tensor(keep, device=states.device)] if len(keep) != len(states) else states
                seqs_now = [rows[n][0] for n in active]
                positions = [rows[n][2] + step - 1 for n in active]
                states = self._run([drafts[ready[n]][-1] for n in active], positions, states, seqs_now,
                                   [1] * len(active), [p + 1 for p in positions])
                tokens = self._greedy(states)
        return [[t for t in draft if t < self.target_vocab_size] for draft in drafts]

    def _run(self, ids: list[int], positions: list[int], hidden: Tensor, seqs: list[Sequence], q_lens: list[int],
             seq_lens: list[int]) -> Tensor:
        """One forward of the MTP layer over a flat batch: each sequence's q_lens[i] tokens end at context
        length seq_lens[i]; K/V go to the sequence's slots in the target's block tables."""
        bs = self.block_size
        tables = [seq.block_table for seq in seqs]
        slots = []
        row = 0
        for table, q_len in zip(tables, q_lens, strict=True):
            slots.extend(table[p // bs] * bs + p % bs for p in positions[row:row + q_len])
            row += q_len
        width = max(len(t) for t in tables)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens))
        return self.mtp(torch.tensor(ids, dtype=torch.int64, device=device),
                        torch.tensor(positions, dtype=torch.int64, device=device), self.kv_caches, metadata,
                        previous_hidden=hidden)

    def _greedy(self, states: Tensor) -> list[int]:
        ids = None
        if self._screened is not None:
            ids = self._screened(states if self._head_norm is None else self._head_norm(states))
        if ids is None:
            ids = self.mtp.compute_logits(states).float().argmax(dim=-1)
        return (ids if self.token_map is None else self.token_map[ids]).tolist()

    def measure_drafts(self, seq: Sequence, drafts: int, timer: Callable[[Callable[[], object]], float]) -> float:
        """timer's seconds for proposing `drafts` drafts after the sequence's last token as a round after a
        rejection runs them: the layer's catch-up row for the last verified position, then drafts - 1 passes.
        Zero rows stand in for the target's hidden states (a pass costs the same whatever they hold); the layer
        writes only the sequence's own slots (its block table must cover the drafts) and keeps nothing after."""
        last = seq.num_tokens - 1
        row = torch.zeros(1, self.mtp.config.hidden_size, dtype=next(self.mtp.parameters()).dtype,
                          device=self.device)

        def round_drafts() -> object:
            self._pending[seq.seq_id] = _Pending(last - 1, [row], 1)
            return self.propose([seq], [drafts])

        try:
            return timer(round_drafts)
        finally:
            self.forget(seq)

    def forget(self, seq: Sequence) -> None:
        self._pending.pop(seq.seq_id, None)


@dataclass(slots=True)
class LoadedHead:
    """A drafting layer fed the target's hidden states (MTP, EAGLE), loaded; its cache comes once the target's
    blocks are counted."""

    module: Any
    vocab_size: int
    kv_bytes_per_block: int
    name: str

    def proposer(self, runner: ModelRunner, num_blocks: int) -> MTPProposer:
        proposer = MTPProposer(self.module, runner, num_blocks, self.vocab_size)
        weights = sum(p.numel() * p.element_size() for p in self.module.parameters())
        logger.info("%s: %.1f MiB of weights, a cache of %.1f MiB (%d blocks) beside the target's", self.name,
                    weights / 2**20, proposer.kv_cache_bytes() / 2**20, num_blocks)
        return proposer


def head_kv_bytes_per_block(module: Any, block_size: int) -> int:
    """Bytes a drafting layer's own cache takes per block (its parameters' dtype, as MTPProposer allocates)."""
    return ModelRunner.kv_bytes_per_block(module, block_size, next(module.parameters()).dtype)


def load_mtp_drafter(target: Target) -> LoadedHead:
    """The target checkpoint's MTP layer, loaded beside the target; ValueError (one line) when the model has
    none."""
    from flashllm.models.loader import checkpoint_quant_spec
    from flashllm.models.mtp_loading import load_mtp, predictor_class
    from flashllm.quant.spec import weight_quant_spec

    config, model = target.config, target.model
    if predictor_class(model) is None:
        raise SpeculativeConfigError(f"--speculate_method mtp needs a DeepSeek-V3 or GLM-4.5 model with MTP layers; "
                                     f"{target.hf_config.architecture} has none (use ngram or draft_model)")
    quant = checkpoint_quant_spec(target.hf_config, weight_quant_spec(
        config.quant.quant_type, config.quant.group_size, config.quant.quantize_lm_head))
    dtype = next(model.parameters()).dtype
    mtp = load_mtp(target.model_dir, model, target.ops, dtype, target.selection.device, quant, target.vocabulary)
    if hasattr(mtp, "set_matrix_absorption"):  # DeepSeek's MLA block
        mtp.set_matrix_absorption(config.model.mla_use_matrix_absorption)
    return LoadedHead(mtp, target.hf_config.vocab_size, head_kv_bytes_per_block(mtp, config.cache.block_size),
                      f"MTP layer of {target.model_dir}")
