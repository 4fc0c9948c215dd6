"""Verifying drafted tokens against the target model: greedy acceptance, and sampled acceptance by drawing.

A sequence with k drafted tokens d_1..d_k gets k + 1 rows of target logits in one forward pass: row j
is the target's distribution p_j for the token after d_1..d_j (row 0 follows the sequence's last
token). Every proposer in flashllm drafts deterministically (the n-gram lookup copies, the draft model
takes its argmax), so the draft distribution q_j is one-hot on d_j.

- Greedy rows: accept d_{j+1} while it equals the target's choice at row j; the first row whose choice
  differs, or row k when every draft was accepted, gives one more token from the target.
- Sampled rows: draw t_j from p_j exactly as a plain step at that position draws (the sampler seeds each
  draw from the request's seed and the output position, core/sampler.py); keep d_{j+1} while it equals
  t_j, and end the round with the first t_j that differs (or t_k when every draft was kept).

The sampled rule is the standard rejection rule (Leviathan et al., 2023) for a one-hot q, realized by
drawing: d_{j+1} is kept with probability p_j(d_{j+1}) = min(1, p_j / q_j), and a t_j that differs is
distributed as p_j without d_{j+1}, normalized: the residual max(0, p_j - q_j). Each emitted token is a
draw from the target's distribution given the tokens before it, and a row after the first mismatch
(conditioned on a draft that was not kept) is never used, so speculation changes how fast tokens come,
never which distribution they come from. Because the noise of a draw depends only on the seed and the
position, a seeded request emits the very tokens it would emit without speculation wherever the verify
rows' logits equal the one-token steps' bit for bit (the cpu backend's kernels keep that), and in any
case tokens that depend on nothing but itself: not on the batch, the proposer or the adaptive guard.
p_j is the sampler's own distribution for the row (penalties, min_tokens, temperature, top-k, top-p,
min-p), computed as if d_1..d_j had already been generated, so penalties see them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from flashllm.core.sampler import Sampler, SamplerOutput, SamplingState, plain_greedy


@dataclass(slots=True)
class Verified:
    """The outcome for one sampling sequence: the tokens it emits (1..k+1) and how many drafts it kept."""

    token_ids: list[int]
    num_drafted: int
    num_accepted: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def row_states(states: list[SamplingState], drafts: list[list[int]]) -> list[SamplingState]:
    """One state per verified row: row j of a sequence sees its drafts d_1..d_j as already generated
    (penalties and min_tokens read them, a structured-output grammar masks what may follow them);
    generators are shared, not copied."""
    rows: list[SamplingState] = []
    for state, draft in zip(states, drafts, strict=True):
        rows.append(state)
        rows.extend(replace(state, output_token_ids=state.output_token_ids + draft[:j],
                            grammar=None if state.grammar is None else state.grammar.after(draft[:j]))
                    for j in range(1, len(draft) + 1))
    return rows


def accept_greedy_tokens(target: list[int], drafts: list[list[int]]) -> list[Verified]:
    """Greedy acceptance from the target's chosen token of every row (rows grouped per sequence,
    1 + len(draft) each, in order)."""
    out: list[Verified] = []
    row = 0
    for draft in drafts:
        chosen = target[row:row + len(draft) + 1]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == chosen[accepted]:
            accepted += 1
        out.append(Verified(chosen[:accepted + 1], len(draft), accepted))
        row += len(draft) + 1
    return out


def verify(sampler: Sampler, logits: Tensor, states: list[SamplingState], drafts: list[list[int]]) -> list[Verified]:
    """Accept or reject every sequence's drafts from the target's logits.

    logits: (R, V) fp32, R = sum(1 + len(d) for d in drafts), each sequence's rows together and in order.
    states[i] / drafts[i]: the i-th sampling sequence's state and drafted tokens (possibly none).
    """
    rows = row_states(states, drafts)
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"verify needs one logits row per sequence and drafted token ({len(rows)}), "
                         f"got shape {tuple(logits.shape)}")
    if all(plain_greedy(s) for s in rows):
        return accept_greedy_tokens(sampler.argmax(logits).tolist(), drafts)
    processed = sampler.process(logits, rows)
    logprobs = sampler.logprobs_of(processed, rows)
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + len(draft) + 1)
    tokens: list[list[int]] = [[] for _ in drafts]
    greedy = [i for i, state in enumerate(states) if state.params.is_greedy]
    sampled = [i for i, state in enumerate(states) if not state.params.is_greedy]
    if greedy:
        index = torch.tensor([r for i in greedy for r in range(starts[i], starts[i + 1])], device=logits.device)
        choice = sampler.argmax(processed[index]).tolist()
        for i, verified in zip(greedy, accept_greedy_tokens(choice, [drafts[i] for i in greedy]), strict=True):
            tokens[i] = verified.token_ids
    if sampled:
        for i, emitted in zip(sampled, _accept_sampled(sampler, processed, rows, starts, drafts, sampled),
                              strict=True):
            tokens[i] = emitted
    out = [Verified(emitted, len(draft), len(emitted) - 1) for emitted, draft in zip(tokens, drafts, strict=True)]
    if logprobs is not None:
        for i, verified in enumerate(out):
            n = len(verified.token_ids)
            ids = torch.tensor(verified.token_ids, device=logits.device)
            verified.logprobs, verified.top_logprobs = sampler.gather_logprobs(
                logprobs[starts[i]:starts[i] + n], ids, rows[starts[i]:starts[i] + n])
    return out


def _accept_sampled(sampler: Sampler, processed: Tensor, rows: list[SamplingState], starts: list[int],
                    drafts: list[list[int]], which: list[int]) -> list[list[int]]:
    """The sampled sequences `which`: row by row, a draw from each still-open sequence's p_j (in one batch per
    row); a sequence stays open while its drawn token is its next draft, so the next row, conditioned on that
    draft, holds the next position's distribution (see the module's docstring)."""
    emitted: dict[int, list[int]] = {i: [] for i in which}
    open_ = list(which)
    j = 0
    while open_:
        index = [starts[i] + j for i in open_]
        drawn_states = [rows[r] for r in index]
        probs = sampler.filtered_probs(processed[torch.tensor(index, device=processed.device)], drawn_states)
        drawn = sampler.draw(probs, drawn_states).tolist()
        still = []
        for i, token in zip(open_, drawn, strict=True):
            emitted[i].append(token)
            if j < len(drafts[i]) and drafts[i][j] == token:
                still.append(i)
        open_, j = still, j + 1
    return [emitted[i] for i in which]


def to_positions(verified: list[Verified]) -> list[SamplerOutput]:
    """Per-sequence results as the runner's per-position outputs: position j holds each sequence's
    j-th emitted token, or None where a sequence emitted fewer (the engine skips those)."""
    depth = max((len(v.token_ids) for v in verified), default=0)
    with_logprobs = any(v.logprobs is not None for v in verified)
    positions: list[SamplerOutput] = []
    for j in range(depth):
        present = [j < len(v.token_ids) for v in verified]
        tokens = [v.token_ids[j] if here else None for v, here in zip(verified, present, strict=True)]
        out = SamplerOutput(tokens)  # type: ignore[arg-type]  # None marks "no token at this position"
        if with_logprobs:
            out.logprobs = [v.logprobs[j] if here and v.logprobs is not None else None
                            for v, here in zip(verified, present, strict=True)]  # type: ignore[misc]
            out.top_logprobs = [v.top_logprobs[j] if here and v.top_logprobs is not None else []
                                for v, here in zip(verified, present, strict=True)]
        positions.append(out)
    return positions
