"""Sampler: turns the last-position logits of a batch into next tokens, one request per row.

Processing order per row (HF `generate` / vLLM semantics):

1. repetition penalty over prompt + output tokens (HF: positive logits divided, negative
   multiplied by the penalty);
2. frequency and presence penalties over output tokens (OpenAI: subtract
   `frequency * count + presence * (count > 0)`);
2b. logit_bias added (OpenAI), and every token outside allowed_token_ids masked (vLLM);
2c. bad_words (vLLM): the last token of each bad word's token sequence is masked where the row's
   last generated tokens are the rest of that sequence (a one-token word: always; core/bad_words.py);
3. min_tokens: stop_token_ids and EOS (unless ignore_eos) are masked while fewer than
   min_tokens were generated;
3b. structured output: tokens the row's grammar does not allow next are masked
   (flashllm.structured; rows without a grammar are untouched);
4. temperature (greedy rows stop here and take the argmax);
5. top-k, then top-p over what top-k kept, then min-p over what is left;
6. draw: argmax of `probs / E` with `E ~ Exp(1)` drawn from the row's own generator, an
   exact sample of `probs` that never looks at other rows. Before each draw the generator is
   seeded from the request's seed and the output position being drawn (position_seed), so a
   token depends only on the seed, the position and the distribution: a seeded request yields
   the same tokens alone or in any batch, and a speculative round's verify rows draw the tokens
   plain steps would (core/spec/verify.py).

Logprobs are `log_softmax` of the logits after steps 1-4 (temperature applied; greedy rows
use temperature 1), i.e. the processed distribution before top-k/top-p/min-p filtering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashllm.core.bad_words import BadWordIds, apply_bad_words
from flashllm.sampling_params import MAX_SEED, SamplingParams
from flashllm.structured.mask import GrammarState, apply_grammar_masks

# Mixes a request seed with a child index (n > 1) so siblings draw different streams while
# child 0 keeps the user's seed unchanged.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Above this top-k a full vocabulary sort is cheaper than a partial one (torch.topk).
_PARTIAL_SORT_MAX_K = 1024


@dataclass
class SamplingState:
    """Per-sequence sampling state: params, private generator and the tokens seen so far.

    `output_token_ids` is appended to by the engine after each step; the sampler only reads it.
    `generator` is None for greedy requests (they draw nothing); `seed` is the one it is re-seeded from
    before each draw (position_seed), None for a generator that runs on unseeded (tests' hand-made states).
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: Sequence[int] = ()
    grammar: GrammarState | None = None  # structured output: the engine advances it as tokens are recorded
    seed: int | None = None
    bad_words_token_ids: BadWordIds = ()  # params.bad_words tokenized (core/bad_words.py), shared by siblings

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        device: torch.device | str,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Sequence[int] = (),
        *,
        index: int = 0,
    ) -> SamplingState:
        """State for one sequence; `index` tells the n siblings of one request apart.

        With `params.seed` the generator is seeded from it (child 0 exactly, children i > 0
        from a mix of seed and i); without one it is seeded from torch's global RNG, so runs
        are reproducible under `torch.manual_seed` yet rows stay independent.
        """
        generator, seed = None, None
        if not params.is_greedy:
            if params.seed is None:
                seed = int(torch.randint(0, MAX_SEED, (1,)).item())
            else:
                seed = (params.seed + index * _GOLDEN_GAMMA) % (MAX_SEED + 1)
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
        return cls(params, generator, prompt_token_ids, eos_token_ids=eos_token_ids, seed=seed)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a sequence's draw of output token `position` (0: the first generated token):
    splitmix64 of the pair, so each position's noise is its own stream and depends on nothing else."""
    z = (seed + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplerOutput:
    """Sampled tokens of a batch, in row order.

    `logprobs[i]` is the chosen token's logprob (None when no row asked for logprobs);
    `top_logprobs[i]` lists `(token_id, logprob)` of the `params.logprobs` most likely tokens,
    most likely first (empty for rows that did not ask). In a speculative round's later positions
    `token_ids[i]` (and its logprob) is None for a sequence that emitted fewer tokens.
    """

    token_ids: list[int | None]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _flat_ids(rows: list[int], id_lists: list[Sequence[int]], vocab_size: int,
              device: torch.device) -> tuple[Tensor, Tensor]:
    """(row index, token id) pairs of ragged id lists; ids the logits cannot hold are dropped."""
    counts = [len(ids) for ids in id_lists]
    ids = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor(counts))
    keep = (ids >= 0) & (ids < vocab_size)
    return row_idx[keep].to(device), ids[keep].to(device)


def _per_pair(states: list[SamplingState], rows: list[int], row_idx: Tensor, attr: str) -> Tensor:
    """params.<attr> of each (row, token) pair's row, as a float tensor like row_idx."""
    values = torch.zeros(len(states), device=row_idx.device)
    values[rows] = torch.tensor([getattr(states[i].params, attr) for i in rows], device=row_idx.device)
    return values[row_idx]


def apply_repetition_penalty(logits: Tensor, states: list[SamplingState]) -> None:
    """In place: HF repetition penalty over prompt + output tokens. logits (B, V) fp32."""
    rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    seen_lists = [list(states[i].prompt_token_ids) + states[i].output_token_ids for i in rows]
    row_idx, ids = _flat_ids(rows, seen_lists, logits.shape[1], logits.device)
    penalty = _per_pair(states, rows, row_idx, "repetition_penalty")
    values = logits[row_idx, ids]
    # Only the seen tokens are touched. A token seen twice reads the same original value
    # twice, so writing both results back is harmless.
    logits[row_idx, ids] = torch.where(values < 0, values * penalty, values / penalty)


def apply_frequency_presence_penalties(logits: Tensor, states: list[SamplingState]) -> None:
    """In place: OpenAI frequency/presence penalties over output tokens. logits (B, V) fp32."""
    rows = [i for i, s in enumerate(states)
            if (s.params.frequency_penalty or s.params.presence_penalty) and s.output_token_ids]
    if not rows:
        return
    vocab_size = logits.shape[1]
    row_idx, ids = _flat_ids(rows, [states[i].output_token_ids for i in rows], vocab_size, logits.device)
    pairs, counts = torch.unique(row_idx * vocab_size + ids, return_counts=True)
    row_idx, ids = pairs // vocab_size, pairs % vocab_size
    freq = _per_pair(states, rows, row_idx, "frequency_penalty")
    presence = _per_pair(states, rows, row_idx, "presence_penalty")
    logits[row_idx, ids] -= freq * counts + presence


def apply_token_biases(logits: Tensor, states: list[SamplingState]) -> None:
    """In place: each row's logit_bias added; tokens outside a row's allowed_token_ids get -inf. logits (B, V)
    fp32; ids the logits cannot hold are ignored (the engine refuses them at add_request)."""
    vocab_size = logits.shape[1]
    for row, state in enumerate(states):
        params = state.params
        if params.allowed_token_ids is not None:
            allowed = torch.tensor([t for t in params.allowed_token_ids if t < vocab_size], dtype=torch.long,
                                   device=logits.device)
            kept = logits[row, allowed]
            logits[row].fill_(float("-inf"))
            logits[row, allowed] = kept
        if params.logit_bias:
            pairs = [(t, b) for t, b in params.logit_bias.items() if t < vocab_size]
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
            logits[row, ids] += torch.tensor([b for _, b in pairs], device=logits.device)


def apply_min_tokens(logits: Tensor, states: list[SamplingState]) -> None:
    """In place: forbid EOS (unless ignore_eos) and stop_token_ids before min_tokens outputs."""
    rows, banned = [], []
    for i, s in enumerate(states):
        if len(s.output_token_ids) < s.params.min_tokens:
            ids = list(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                ids += list(s.eos_token_ids)
            rows.append(i)
            banned.append(ids)
    if rows:
        row_idx, ids = _flat_ids(rows, banned, logits.shape[1], logits.device)
        logits[row_idx, ids] = float("-inf")


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> None:
    """In place: mask (to -inf) tokens outside top-k, then outside the top-p nucleus.

    logits (B, V) fp32; top_k (B,) long with V meaning "off"; top_p (B,) fp32 with 1 = off.
    Ties at the k-th value are all kept, and the most likely token always survives top-p,
    matching transformers' TopKLogitsWarper / TopPLogitsWarper. When every row has a small
    top-k, only the candidates are sorted (topk) instead of the whole vocabulary.
    """
    vocab_size = logits.shape[1]
    if int(top_k.max()) > _PARTIAL_SORT_MAX_K:
        _top_k_top_p_full_sort(logits, top_k, top_p)
        return
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).clamp(0, vocab_size - 1).unsqueeze(1))
    remove = logits < kth
    if bool((top_p < 1).any()):
        kept = int((~remove).sum(dim=1).max())
        values, idx = logits.masked_fill(remove, float("-inf")).topk(kept, dim=-1)
        values, idx = values.flip(1), idx.flip(1)  # ascending, as in the full sort
        drop = values.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # masked candidates have zero mass, so drop is already True for them
        remove.scatter_(1, idx, drop)
    logits.masked_fill_(remove, float("-inf"))


def _top_k_top_p_full_sort(logits: Tensor, top_k: Tensor, top_p: Tensor) -> None:
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending
    vocab_size = logits.shape[1]
    kth = sorted_logits.gather(1, (vocab_size - top_k).clamp(0, vocab_size - 1).unsqueeze(1))
    remove = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove |= cumulative <= (1 - top_p).unsqueeze(1)
    remove[:, -1] = False
    logits.masked_fill_(remove.scatter(1, sorted_idx, remove), float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor) -> None:
    """In place: mask tokens whose probability is below `min_p * max probability`. (B, V)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


def plain_greedy(state: SamplingState) -> bool:
    """A greedy row with no penalty, no bias, no bad words, no pending min_tokens ban, no logprobs and no grammar:
    its token is the argmax."""
    params = state.params
    return (params.is_greedy and params.logprobs is None and params.repetition_penalty == 1.0
            and not params.logit_bias and params.allowed_token_ids is None and not state.bad_words_token_ids
            and not ((params.frequency_penalty or params.presence_penalty) and state.output_token_ids)
            and len(state.output_token_ids) >= params.min_tokens and state.grammar is None)


class Sampler:
    """Picks the next token of every row of a batch; see the module docstring for the order.

    `argmax` maps (B, V) rows to each row's index of its largest value as torch's argmax does;
    the engine passes its device adapter's (DeviceAdapter.argmax), which may be faster.
    """

    def __init__(self, argmax: Callable[[Tensor], Tensor] | None = None) -> None:
        self._argmax = argmax or (lambda rows: rows.argmax(dim=-1))

    def argmax(self, rows: Tensor) -> Tensor:
        """(B, V) -> (B,) int64: each row's index of its largest value, as torch's argmax."""
        return self._argmax(rows)

    def __call__(self, logits: Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample one token per row.

        logits: (B, V), any float dtype, on the model's device (processed in fp32).
        states: B SamplingState, row i of logits belongs to states[i].
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be (num_seqs, vocab_size) with one row per state; "
                             f"got shape {tuple(logits.shape)} for {len(states)} states")
        if all(plain_greedy(s) for s in states):
            # nothing below would change a row: skip the fp32 copy, the divide and the row gather
            # (~4 ms a step for 16 rows of a 152k vocabulary on the 2-core test VM)
            return SamplerOutput(self._argmax(logits).tolist())
        logits = self.process(logits, states)
        logprobs = self.logprobs_of(logits, states)
        token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        sampled = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy:
            token_ids[greedy] = self._argmax(logits[greedy])
        if sampled:
            # filtered_probs masks in place: it gets a copy unless no greedy row needs the originals.
            rows = logits if not greedy else logits[sampled]
            sampled_states = [states[i] for i in sampled]
            token_ids[sampled] = self.draw(self.filtered_probs(rows, sampled_states), sampled_states)
        chosen = token_ids.tolist()
        if logprobs is None:
            return SamplerOutput(chosen)
        return SamplerOutput(chosen, *self.gather_logprobs(logprobs, token_ids, states))

    @staticmethod
    def process(logits: Tensor, states: list[SamplingState]) -> Tensor:
        """Steps 1-4 on a private fp32 copy of (B, V) logits: penalties, biases, bad words, the min_tokens ban and
        temperature (greedy rows keep temperature 1)."""
        logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
        apply_repetition_penalty(logits, states)
        apply_frequency_presence_penalties(logits, states)
        apply_token_biases(logits, states)
        apply_bad_words(logits, [s.bad_words_token_ids for s in states], [s.output_token_ids for s in states])
        apply_min_tokens(logits, states)
        apply_grammar_masks(logits, [s.grammar for s in states])  # structured output (flashllm.structured)
        temperature = torch.tensor(
            [1.0 if s.params.is_greedy else s.params.temperature for s in states],
            device=logits.device)
        logits /= temperature.unsqueeze(1)
        return logits

    @staticmethod
    def filtered_probs(logits: Tensor, states: list[SamplingState]) -> Tensor:
        """Step 5 for sampled rows: processed (S, V) fp32 logits, masked in place by top-k, top-p and
        min-p, -> the (S, V) probabilities a draw samples from."""
        vocab_size = logits.shape[1]
        top_k = [s.params.top_k if s.params.top_k > 0 else vocab_size for s in states]
        top_p = [s.params.top_p for s in states]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            apply_top_k_top_p(logits, torch.tensor(top_k, device=logits.device).clamp(max=vocab_size),
                              torch.tensor(top_p, device=logits.device))
        if any(s.params.min_p > 0 for s in states):
            apply_min_p(logits, torch.tensor([s.params.min_p for s in states], device=logits.device))
        return logits.softmax(dim=-1)

    def draw(self, probs: Tensor, states: list[SamplingState]) -> Tensor:
        """Step 6: one token per row of (S, V) non-negative weights (probabilities, or any weights
        proportional to the distribution to sample), each row from its state's generator, seeded for the
        state's next output position -> (S,) int64."""
        vocab_size = probs.shape[1]
        noise = torch.empty_like(probs)
        for row, state in enumerate(states):
            if state.seed is not None:
                state.generator.manual_seed(position_seed(state.seed, len(state.output_token_ids)))
            torch.rand(vocab_size, generator=state.generator, out=noise[row])
        # -log(U) ~ Exp(1); rand + log is several times faster than exponential_ on CPU. The
        # clamp keeps E > 0: a masked token's 0 / 0 would be NaN, which argmax prefers.
        noise = noise.log_().neg_().clamp_(min=torch.finfo(noise.dtype).tiny)
        return self._argmax(probs / noise)

    @staticmethod
    def logprobs_of(logits: Tensor, states: list[SamplingState]) -> Tensor | None:
        """log_softmax of processed (B, V) logits, or None when no row asked for logprobs."""
        if all(s.params.logprobs is None for s in states):
            return None
        return logits.log_softmax(dim=-1)

    @staticmethod
    def gather_logprobs(logprobs: Tensor, token_ids: Tensor, states: list[SamplingState]
                         ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
        max_k = max(s.params.logprobs or 0 for s in states)
        top: list[list[tuple[int, float]]] = [[] for _ in states]
        if max_k > 0:
            values, indices = logprobs.topk(min(max_k, logprobs.shape[1]), dim=-1)
            values, indices = values.tolist(), indices.tolist()
            for row, state in enumerate(states):
                k = state.params.logprobs or 0
                top[row] = list(zip(indices[row][:k], values[row][:k], strict=True))
        return chosen, top
