"""Embeddings (SamplingParams.pooling): a prompt's hidden states pooled into one vector during prefill."""

from __future__ import annotations

import torch

from flashllm.core.sequence import Sequence


def pooling_rows(seq: Sequence, first_row: int, start: int, end: int) -> list[tuple[Sequence, int, int, int]]:
    """The (seq, first row, first position, rows) entry for a chunk of prompt positions [start, end) starting
    at token row first_row that the sequence's pooling reads; else []. "last" reads the last prompt position,
    "cls" position 0, "mean" every prompt position."""
    pooling = getattr(seq.sampling_params, "pooling", None)
    last = seq.num_prompt_tokens
    if pooling is None or start >= last:
        return []
    if pooling.type == "last":
        return [(seq, first_row + last - 1 - start, last - 1, 1)] if end >= last else []
    if pooling.type == "cls":
        return [(seq, first_row, 0, 1)] if start == 0 else []
    return [(seq, first_row, start, min(end, last) - start)]


def record_pooled(hidden: torch.Tensor, entries: list[tuple[Sequence, int, int, int]]) -> None:
    """Fold each entry's rows of the step's (T, H) hidden states into its seq.pooled, in fp32: the row itself
    ("last", "cls"), or added to the running sum ("mean"; a chunk at position 0 starts it again, so a
    preempted and recomputed prompt is not counted twice)."""
    for seq, first_row, first_pos, count in entries:
        rows = hidden[first_row: first_row + count].float()
        if seq.sampling_params.pooling.type != "mean":  # type: ignore[union-attr]
            seq.pooled = rows[0].clone()
        elif first_pos == 0 or seq.pooled is None:
            seq.pooled = rows.sum(dim=0)
        else:
            seq.pooled += rows.sum(dim=0)


def embedding(seq: Sequence) -> list[float] | None:
    """The embedding of a sequence whose prompt has run (mean taken, cut to `dimensions`, normalized); None
    when nothing was pooled."""
    pooling = seq.sampling_params.pooling  # type: ignore[union-attr]
    if seq.pooled is None:
        return None
    vector = seq.pooled / seq.num_prompt_tokens if pooling.type == "mean" else seq.pooled
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().tolist()
