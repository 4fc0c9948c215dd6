"""Per-sequence recurrent state for layers that are not attention (short convolutions, Mamba, linear attention).

Such a layer keeps, per running sequence, a fixed-size state that sums up every token before it (no paged KV):
the runner allocates one slot of each state tensor per seat (CausalLM.state_cache_shapes) and says in
attn_metadata.state_slots which slot is whose. A model computes `state_spans(attn_metadata)` once per forward
and hands it to its recurrent layers; each reads a sequence's state where its context before the pass is not
empty (a later prefill chunk, a decode), starts from zeros where it is, and writes the state after the pass's
last token back. With attn_metadata.state_slots None (a pass that keeps no state: the memory profile, a scoring
pass over whole sequences) every sequence starts from zeros and nothing is written.

`causal_conv1d` is the depthwise causal convolution with carried state that LFM2's short convolutions, Mamba's
and Gated DeltaNet's input convolutions all run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.layers.linear import copy_checked
from flashllm.ops.attention_metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class StateSpans:
    """The sequences of one flat batch that have tokens in it, as recurrent layers walk them.

    starts / ends: each sequence's token rows [start, end) in the flat batch (host ints).
    slots:         its state slot, or None for every sequence when the pass keeps no state.
    fresh:         whether its context before this pass is empty (it starts from a zero state).
    decode_only:   every sequence brings exactly one token (the vectorized path).
    rows, slot_index, fresh_mask: (n,) tensors on the batch's device of starts, slots (0 where None) and fresh.
    """

    starts: list[int]
    ends: list[int]
    slots: list[int] | None
    fresh: list[bool]
    decode_only: bool
    rows: Tensor
    slot_index: Tensor
    fresh_mask: Tensor

    def __len__(self) -> int:
        return len(self.starts)


def state_spans(md: AttentionMetadata) -> StateSpans:
    """The batch's sequences with at least one token (padding sequences have none), read to the host once."""
    cu = md.cu_seqlens_q.tolist()
    seq_lens = md.seq_lens.tolist()
    all_slots = md.state_slots.tolist() if md.state_slots is not None else None
    starts, ends, slots, fresh = [], [], [], []
    for b, context in enumerate(seq_lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        starts.append(start)
        ends.append(end)
        fresh.append(context == end - start)
        if all_slots is not None:
            slots.append(all_slots[b])
    device = md.cu_seqlens_q.device
    keep = all_slots is not None
    return StateSpans(
        starts, ends, slots if keep else None, fresh,
        decode_only=all(e - s == 1 for s, e in zip(starts, ends, strict=True)),
        rows=torch.tensor(starts, dtype=torch.int64, device=device),
        slot_index=torch.tensor(slots if keep else [0] * len(starts), dtype=torch.int64, device=device),
        fresh_mask=torch.tensor(fresh, dtype=torch.bool, device=device),
    )


def read_states(state: Tensor | None, spans: StateSpans, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """(n, *shape) starting states of the spans' sequences: their slots' contents, zeros where fresh or kept
    nowhere."""
    if state is None or spans.slots is None:
        return torch.zeros((len(spans), *shape), dtype=dtype, device=device)
    current = state.index_select(0, spans.slot_index).to(dtype)
    return current.masked_fill(spans.fresh_mask.view(-1, *([1] * len(shape))), 0)


def write_states(state: Tensor | None, spans: StateSpans, values: Tensor) -> None:
    """Store each sequence's (n, ...) final state in its slot (nothing when the pass keeps none)."""
    if state is not None and spans.slots is not None:
        state.index_copy_(0, spans.slot_index, values.to(state.dtype))


def sequence_state(state: Tensor | None, spans: StateSpans, i: int, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> Tensor:
    """Sequence i's starting state (shape), as read_states gives it, for layers that walk sequences one by one."""
    if state is None or spans.slots is None or spans.fresh[i]:
        return torch.zeros(shape, dtype=dtype, device=device)
    return state[spans.slots[i]].to(dtype)


def store_sequence_state(state: Tensor | None, spans: StateSpans, i: int, value: Tensor) -> None:
    """Sequence i's final state into its slot (nothing when the pass keeps none)."""
    if state is not None and spans.slots is not None:
        state[spans.slots[i]] = value.to(state.dtype)


def split_caches(kv_caches: list[tuple[Tensor, ...]], num_attention: int, num_recurrent: int,
                 attn_metadata: AttentionMetadata) -> tuple[list[tuple[Tensor, ...]], list[tuple[Tensor | None, ...]]]:
    """forward's kv_caches -> (the attention layers' caches, the recurrent layers' state tuples). A pass that keeps
    no state (attn_metadata.state_slots None) may bring the attention caches alone; its recurrent layers then get
    (None, None) and start every sequence from zeros. Raises ValueError on any other count."""
    if len(kv_caches) == num_attention and attn_metadata.state_slots is None:
        return list(kv_caches), [(None, None)] * num_recurrent
    if len(kv_caches) != num_attention + num_recurrent:
        raise ValueError(f"got {len(kv_caches)} caches for {num_attention} attention and {num_recurrent} recurrent "
                         "layers; pass the attention layers' (k_cache, v_cache) and then one state tuple per "
                         "recurrent layer (see kv_cache_shape() and state_cache_shapes())")
    return list(kv_caches[:num_attention]), list(kv_caches[num_attention:])


def sharded_rows_loader(full_sizes: tuple[int, ...], tp_rank: int, tp_size: int) -> Any:
    """A weight loader for a parameter whose rows are the segments `full_sizes` one after another (a convolution's
    [x | B | C] channels; one segment for per-channel or per-head vectors): this rank takes its 1/tp_size of each."""

    def load(param: Tensor, loaded: Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not fused; got shard_id={shard_id!r}")
        if loaded.shape[0] != sum(full_sizes) or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match ({sum(full_sizes)}, "
                             f"{', '.join(map(str, param.shape[1:]))}); the checkpoint does not match its config.json")
        offset = start = 0
        for size in full_sizes:
            part = size // tp_size
            copy_checked(param.narrow(0, offset, part), loaded.narrow(0, start + tp_rank * part, part))
            offset, start = offset + part, start + size

    return load


def sharded_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader: Any) -> nn.Parameter:
    """A zeroed parameter of this rank's shape that `loader` fills from the checkpoint tensor."""
    param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


def channel_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tp_rank: int,
                  tp_size: int) -> nn.Parameter:
    """A parameter whose first dimension is channels split evenly over the ranks: this rank's rows of it."""
    return sharded_param(shape, dtype, device, sharded_rows_loader((shape[0] * tp_size,), tp_rank, tp_size))


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor | None, spans: StateSpans,
                  activation: str | None = None) -> Tensor:
    """Depthwise causal convolution over each sequence of a flat batch, continuing from its carried inputs.

    x (T, C) in the model dtype; weight (C, K); bias (C,) or None; conv_state (num_slots, C, K - 1): the last
    K - 1 inputs of each slot's sequence (zeros before its first), updated in place with each sequence's last
    K - 1 inputs (earlier state included where it has fewer tokens). Output row t of a sequence is
    sum_k weight[:, k] * input[t - (K - 1) + k] (+ bias), then `activation` ("silu" or None); (T, C), rows past
    the last sequence zero. Computed in x's dtype.
    """
    channels, width = weight.shape
    out = torch.zeros_like(x)
    if not len(spans):
        return out
    if spans.decode_only:  # one token each: a window of K inputs per sequence, vectorized
        previous = read_states(conv_state, spans, (channels, width - 1), x.dtype, x.device)
        window = torch.cat([previous, x.index_select(0, spans.rows).unsqueeze(-1)], dim=-1)  # (n, C, K)
        y = (window * weight).sum(-1)
        y = y + bias if bias is not None else y
        out.index_copy_(0, spans.rows, _activate(y, activation))
        write_states(conv_state, spans, window[..., 1:])
        return out
    kernel = weight.unsqueeze(1)  # (C, 1, K): one filter per channel
    for i, (start, end) in enumerate(zip(spans.starts, spans.ends, strict=True)):
        previous = sequence_state(conv_state, spans, i, (channels, width - 1), x.dtype, x.device)
        inputs = torch.cat([previous, x[start:end].t()], dim=-1)  # (C, K - 1 + L)
        y = F.conv1d(inputs.unsqueeze(0), kernel, bias, groups=channels)[0].t()  # (L, C)
        out[start:end] = _activate(y, activation)
        store_sequence_state(conv_state, spans, i, inputs[:, inputs.shape[1] - (width - 1):])
    return out


def _activate(y: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"causal_conv1d activation {activation!r} is not one of silu, None")
