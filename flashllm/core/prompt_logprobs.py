"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob, computed during prefill."""

from __future__ import annotations

from typing import Any

import torch

from flashllm.core.sequence import Sequence

# logits rows computed at once: bounds the (rows, vocab) fp32 block a long prefill chunk would need
_ROWS_PER_BLOCK = 256


def prompt_logprob_rows(seq: Sequence, first_row: int, start: int, end: int) -> list[tuple[Sequence, int, int, int]]:
    """The (seq, first row, first position, rows) entry for a chunk of positions [start, end) starting at token row
    first_row, when seq wants prompt logprobs and the chunk holds a position whose next token is a prompt token;
    else []. Position p's logits predict token p + 1."""
    wanted = getattr(seq.sampling_params, "prompt_logprobs", None)
    last = min(end, seq.num_prompt_tokens - 1)  # positions start .. last-1 predict prompt tokens
    if wanted is None or start >= last:
        return []
    return [(seq, first_row, start, last - start)]


def logit_blocks(entries: list[tuple[Sequence, int, int, int]]) -> list[tuple[int, int]]:
    """(first token row, rows) of each compute_logits call record_prompt_logprobs makes, in its order: what the
    other tensor-parallel ranks repeat, since the vocabulary-parallel LM head gathers over every rank."""
    return [(first_row + offset, min(_ROWS_PER_BLOCK, count - offset))
            for _, first_row, _, count in entries for offset in range(0, count, _ROWS_PER_BLOCK)]


def join_logit_gathers(model: Any, hidden: torch.Tensor, blocks: list[tuple[int, int]]) -> None:
    """Another tensor-parallel rank's part of the driver's prompt logprobs: the same compute_logits calls, whose
    gathers need every rank; the logits are dropped."""
    for first_row, rows in blocks:
        model.compute_logits(hidden[first_row: first_row + rows])


def record_prompt_logprobs(model: Any, hidden: torch.Tensor, entries: list[tuple[Sequence, int, int, int]]) -> None:
    """Write into each entry's seq.prompt_logprobs, by position of the predicted token, (logprob, top-k list).

    hidden: (T, H) the step's hidden states, one row per scheduled token. The logits are the model's
    compute_logits in fp32, log-softmaxed over the whole vocabulary (no temperature or penalties): the
    distribution the model itself gives the prompt."""
    for seq, first_row, first_pos, count in entries:
        k = int(seq.sampling_params.prompt_logprobs)  # type: ignore[union-attr]
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = {}
        for offset in range(0, count, _ROWS_PER_BLOCK):
            n = min(_ROWS_PER_BLOCK, count - offset)
            rows = hidden[first_row + offset: first_row + offset + n]
            logprobs = model.compute_logits(rows).float().log_softmax(dim=-1)
            pos0 = first_pos + offset + 1  # the position of the first token these rows predict
            targets = torch.tensor(seq.token_ids[pos0: pos0 + n], device=logprobs.device)
            chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            if k > 0:
                values, indices = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
            else:
                tops = [[] for _ in range(n)]
            for j in range(n):
                seq.prompt_logprobs[pos0 + j] = (chosen[j], tops[j])
