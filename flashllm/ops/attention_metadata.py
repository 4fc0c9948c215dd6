"""AttentionMetadata: how one flat varlen batch maps onto sequences and the paged KV cache (attention's inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one forward pass over a flat batch of T tokens from B sequences.

    For sequence b, the batch holds its last `q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]`
    tokens of a context of `seq_lens[b]` tokens (cached prefix + new tokens). The new tokens' keys
    and values are written to the cache (by `slot_mapping`) before attention reads it.

    slot_mapping:  (T,) int64, `block * block_size + offset` of each token's KV slot; -1 = skip.
    cu_seqlens_q:  (B+1,) int32, prefix sums of per-sequence query lengths.
    seq_lens:      (B,) int32, context length of each sequence including the new tokens.
    block_tables:  (B, max_blocks) int32, physical block ids of each sequence (padded with 0).
    max_seqlen_q / max_seqlen_k: host-side maxima of the query and context lengths.
    prompt_lens:   (B,) int32, each sequence's prompt length, or None where the caller did not fill it
                   (the runner fills it for models with `reads_prompt_lens`, e.g. QWen's dynamic NTK,
                   whose RoPE base a sequence's prompt length picks); readers then take seq_lens, which
                   is right for a whole prompt in one pass.
    state_slots:   (B,) int64, each sequence's slot in the recurrent-state caches of a model that keeps
                   per-sequence state (CausalLM.state_cache_shapes: Mamba / short-conv layers), -1 for a
                   padding sequence; None for a model without such state, or a pass whose sequences all start
                   from a zero state and keep none (the memory profile's). A sequence whose context before
                   this pass is empty (seq_lens - q_len == 0) starts from a zero state whatever its slot holds.
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    prompt_lens: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
