"""The cpu backend's model runner: fused decode steps, the greedy LM head and multi-step greedy decode.

The generic runner (flashllm/core/model_runner.py) runs the model's own forward, computes logits
and samples. On the CPU a decode step spends much of its time outside the weight streams, so this
runner takes three shortcuts where the model declares the fusions they need (see
flashllm/registry/fusions.py) and the step allows them, each computing exactly what the generic
path computes:

- the fused decode step (decode_stack.py): the decoder stack of a decode batch in one native call;
- the greedy head (greedy_screen.py): plain greedy rows' tokens from a smaller copy of the LM head
  and a proven error bound, without their fp32 logits;
- multi-step greedy decode (decode_burst.py): up to the engine's bound of greedy decode steps of
  the same sequences in one native call, each step's tokens fed to the next.

Its KV cache is backed by memory only where written, and freed blocks' pages go back to the OS
(kv_pages.py), so resident memory follows the blocks in use.

Decode-sized steps also run torch single-threaded while the native kernels use their own threads,
and argmax goes through numpy (parallel.py, CpuRunner.argmax).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from flashllm.backends.cpu import parallel
from flashllm.core.model_runner import ModelInput, ModelRunner
from flashllm.core.sampler import SamplerOutput, SamplingState, plain_greedy
from flashllm.core.scheduler import SchedulerOutput
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.registry.backend import DeviceAdapter

# The most steps one call may run: the engine's num_scheduler_steps bounds it further.
MAX_STEPS_PER_CALL = 64
_UNBUILT: Any = False  # a fast path not built yet (None: built, and it does not apply)


def numpy_argmax(rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows through numpy: the same indices as torch's argmax (first on ties, NaN largest), many
    times faster than torch's row reduction on the CPU for vocabulary-wide rows."""
    if (rows.dtype != torch.float32 or rows.device.type != "cpu" or rows.dim() != 2 or rows.shape[1] == 0
            or rows.requires_grad):
        return rows.argmax(dim=-1)
    return torch.from_numpy(rows.numpy().argmax(axis=-1))


def step_context(num_tokens: int) -> AbstractContextManager[Any]:
    """Decode-sized steps run torch single-threaded while the GEMVs use flashllm's own threads."""
    return parallel.torch_single_threaded() if num_tokens <= parallel.SPLIT_MAX_TOKENS else nullcontext()


class CpuRunner(ModelRunner):
    """The generic runner plus the cpu backend's fused decode, greedy head and multi-step decode."""

    bursts_feed_hidden_sink = True  # execute_burst hands each step's hidden states (and taps) over

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from flashllm.backends.cpu.kv_pages import KVPages

        self.kv_pages = KVPages()  # before the generic runner allocates the caches through kv_zeros
        self.releases_kv_memory = self.kv_pages.lazy
        super().__init__(*args, **kwargs)
        self._fused_decode: Any = _UNBUILT
        self._greedy_head: Any = _UNBUILT
        self._greedy_burst: Any = _UNBUILT
        self._subset: Any = None  # a drafter's greedy vocabulary (draft_vocab.py), and its bursts
        self._subset_burst: Any = None

    @classmethod
    def place_empty_weights(cls, model: torch.nn.Module) -> None:
        """Large parameters into huge pages before loading writes them (huge_pages.place_empty)."""
        from flashllm.backends.cpu import huge_pages

        huge_pages.place_empty(model)

    @classmethod
    def prepare_model(cls, model: torch.nn.Module, adapter: DeviceAdapter) -> None:
        """Weights into huge pages (huge_pages.py), and the greedy head's copy of the LM head made
        now, so the KV cache is sized with it in memory."""
        from flashllm.backends.cpu import greedy_screen, heap, huge_pages

        placed, moved = huge_pages.place_weights(model)
        if placed:
            import logging

            # most are loaded straight into them (place_empty_weights); the rest are copied there now
            logging.getLogger(__name__).info("weights: %.2f GiB in 2 MiB pages (%.2f GiB of it copied after loading)",
                                             placed / 2**30, moved / 2**30)
        greedy_screen.build(model, numpy_argmax)
        # loading's and the builds' freed buffers go back before the heap starts keeping what is freed
        heap.trim_heap()
        heap.keep_freed_memory()

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        return numpy_argmax(rows)

    def kv_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A KV cache tensor whose pages are backed only once written (kv_pages.py)."""
        return self.kv_pages.zeros(shape, dtype, device)

    def release_kv_blocks(self, block_ids: list[int]) -> None:
        """The pages of these free blocks go back to the OS (kv_pages.py)."""
        self.kv_pages.release(block_ids)

    def kv_resident_bytes(self) -> int:
        """Bytes of the KV cache now in memory (0 where the cache is not lazily backed)."""
        return self.kv_pages.resident_bytes()

    def _fast(self) -> bool:
        """Whether the fused paths may run: no device graphs or shape buckets in the way, and no recurrent
        state the fused decoder stack would not carry (a hybrid model may inherit a decoder's fusions)."""
        return self.graphs is None and self.shape_buckets is None and not self._keeps_state

    def _burst(self) -> Any:
        if self._greedy_burst is _UNBUILT:
            from flashllm.backends.cpu import decode_burst

            self._greedy_burst = decode_burst.build(self.model, self.argmax) if self._fast() else None
        if self._subset is not None and self._greedy_burst is not None:
            return self._subset_burst
        return self._greedy_burst

    def restrict_greedy_vocabulary(self, ids: list[int] | None) -> bool:
        """Greedy tokens from the greedy head's rows of these ids only (draft_vocab.py), in single steps and
        bursts; False (nothing restricted) where this model has no greedy head."""
        if ids is None:
            self._subset = self._subset_burst = None
            return True
        if self._screen() is None:
            return False
        if self._subset is None:
            from flashllm.backends.cpu import decode_burst, draft_vocab

            subset = draft_vocab.GreedySubset(self._greedy_head)
            subset.choose(ids)
            self._burst()
            full = self._greedy_burst
            self._subset_burst = None if full is None else decode_burst.GreedyBurst(full.fused, subset)
            self._subset = subset
        elif ids != self._subset.chosen:
            self._subset.choose(ids)
        return True

    def max_tokens_per_step(self, states: list[SamplingState]) -> int:
        """Several steps for a batch of plain greedy sequences without presence or frequency penalties
        (they would change from token to token) that the multi-step call takes."""
        if not states or any(not plain_greedy(s) or s.params.frequency_penalty or s.params.presence_penalty
                             for s in states):
            return 1
        burst = self._burst()
        return MAX_STEPS_PER_CALL if burst is not None and burst.takes(len(states)) else 1

    def execute(self, batch: SchedulerOutput, states: list[SamplingState], max_steps: int = 1) -> list[SamplerOutput]:
        num_tokens = sum(item.num_new_tokens for item in batch.scheduled)
        with step_context(num_tokens):  # sampling included: it runs between the native calls too
            if max_steps > 1:
                rows = self.execute_burst(batch, states, max_steps)
                if rows is not None:
                    return [SamplerOutput(tokens) for tokens in rows]
            return super().execute(batch, states, 1)

    def execute_inputs(self, inputs: ModelInput, greedy: bool = False) -> torch.Tensor:
        with step_context(int(inputs.input_ids.numel())):
            return super().execute_inputs(inputs, greedy)

    def execute_burst(self, batch: SchedulerOutput, states: list[SamplingState],
                      steps: int) -> list[list[int]] | None:
        """Up to `steps` plain greedy decode steps of this batch in one native call: their tokens,
        [step][sequence in batch order], ending early after a step that produced a stop token of any
        sequence; None where the call does not take the batch (a single step runs instead).

        Every scheduled sequence must bring one token and sample, and its block table must already
        cover all `steps` positions. Sequences are not updated here."""
        burst = self._burst()
        if burst is None or len(states) != len(batch.scheduled):
            return None
        stop_ids: set[int] = set()
        for state in states:
            stop_ids.update(state.params.stop_token_ids)
            if not state.params.ignore_eos:
                stop_ids.update(state.eos_token_ids)
        inputs = self.prepare(batch)
        sink, first, hidden = self.hidden_sink, None, None
        if sink is not None:  # a drafter reads each step's hidden states; the burst moves ids and positions on
            first = (inputs.input_ids.clone(), inputs.positions.clone())
            hidden = torch.empty(steps, len(states), burst.fused.hidden_size)
        with self.adapter.inference_mode():  # each sequence keeps its adapter slot for every step
            tokens = burst(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, steps, stop_ids,
                           self._lora_slots(), states=hidden)
            self.adapter.end_step(self.device)
        if tokens is not None and sink is not None:
            burst.fused.keep_burst_taps(len(tokens))
            self._sink_burst(sink, inputs, first, tokens, hidden)
        return tokens

    def _sink_burst(self, sink: Any, inputs: ModelInput, first: tuple[torch.Tensor, torch.Tensor],
                    tokens: list[list[int]], states: torch.Tensor) -> None:
        """Hand a burst's rows to hidden_sink as the rows of one chunk per sequence: sequence b's `done` steps
        (its tokens at positions p_b, p_b + 1, ...) in order, with their final hidden states and, where the stack
        keeps taps, its tapped streams, as single steps would have handed them over one by one."""
        from flashllm.backends.cpu import decode_stack

        done, count = len(tokens), len(tokens[0])
        ids, starts = first
        fed = torch.tensor([ids.tolist(), *tokens[:-1]], dtype=torch.int64)  # (done, T): each step's input ids
        steps = torch.arange(done, dtype=torch.int64)
        positions = (starts[:, None] + steps[None, :]).reshape(-1)
        md = inputs.attn_metadata
        tables = md.block_tables
        size = self.block_size
        rows = torch.arange(count).repeat_interleave(done)
        slots = tables[rows, positions // size].to(torch.int64) * size + positions % size
        seq_lens = (starts + done).to(torch.int32)
        chunk = ModelInput(
            input_ids=fed.t().reshape(-1), positions=positions,
            attn_metadata=AttentionMetadata(slot_mapping=slots,
                                            cu_seqlens_q=torch.arange(count + 1, dtype=torch.int32) * done,
                                            seq_lens=seq_lens, block_tables=tables, max_seqlen_q=done,
                                            max_seqlen_k=int(seq_lens.max())),
            logits_indices=torch.arange(1, count + 1, dtype=torch.int64) * done - 1, seq_ids=inputs.seq_ids)
        sink(chunk, decode_stack.by_sequence(states[:done].view(done * count, -1), done))

    def _forward(self, inputs: ModelInput) -> torch.Tensor:
        if self._fused_decode is _UNBUILT:  # built after loading, once the weights are final
            from flashllm.backends.cpu import decode_stack

            self._fused_decode = decode_stack.build(self.model) if self._fast() else None
        if self._fused_decode is not None:
            hidden = self._fused_decode(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata,
                                        self._lora_slots())
            if hidden is not None:
                return hidden
        return super()._forward(inputs)

    def _lora_slots(self) -> torch.Tensor | None:
        """The prepared step's per-token adapter slots (-1: base), or None when no row has an adapter."""
        return None if self.lora is None else self.lora.context.indices

    def _screen(self) -> Any:
        if self._greedy_head is _UNBUILT:
            from flashllm.backends.cpu import greedy_screen

            self._greedy_head = greedy_screen.build(self.model, self.argmax)
        return self._greedy_head

    def _greedy_tokens(self, rows: torch.Tensor) -> torch.Tensor | None:
        head = self._screen() if self._subset is None else self._subset
        return head(rows) if head is not None else None

    def greedy_head(self, head: Any) -> Any:
        """A drafter's LM head screened like the model's own (greedy_screen.py), where it qualifies."""
        from flashllm.backends.cpu import greedy_screen

        return greedy_screen.for_head(head, self.argmax)
