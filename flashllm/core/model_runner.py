"""ModelRunner: owns the paged KV cache, turns a scheduled batch into one forward pass and samples it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from flashllm.core.pooling import pooling_rows, record_pooled
from flashllm.core.prompt_logprobs import join_logit_gathers, logit_blocks, prompt_logprob_rows, record_prompt_logprobs
from flashllm.core.sampler import Sampler, SamplerOutput, SamplingState, plain_greedy
from flashllm.core.scheduler import SchedulerOutput
from flashllm.core.sequence import Sequence
from flashllm.core.spec import verify
from flashllm.core.step_graphs import PAD_SLOT, DecodeGraphs, graph_batch_sizes
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.registry.backend import DeviceAdapter, ShapeBuckets
from flashllm.structured.mask import prefetch_masks

# How int8/fp8 KV caches get their scales (PaddleNLP's --cachekv_int8_type): per written token
# and head, or calibrated per layer and stored in the checkpoint.
KV_SCALE_TYPES = ("dynamic", "static")


@dataclass(slots=True)
class ModelInput:
    """The flat batch of one step.

    input_ids, positions: (T,) int64 over all scheduled tokens, sequence after sequence.
    logits_indices:       (N,) int64, the last token of each sequence that samples this step.
    num_logits:           None, or with shape buckets the number of real rows at the front of
                          logits_indices (the rest are padding that points at token 0).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    num_logits: int | None = None
    # SamplingParams.prompt_logprobs: (sequence, first token row, first position, rows) per chunk holding
    # prompt positions whose next prompt token gets its logprob (flashllm.core.prompt_logprobs)
    prompt_logprobs: list[tuple[Sequence, int, int, int]] | None = None
    # the (first token row, rows) of each LM-head call those make (prompt_logprobs.logit_blocks): what the other
    # tensor-parallel ranks receive instead of the entries, to join the head's gathers
    prompt_logit_blocks: list[tuple[int, int]] | None = None
    # SamplingParams.pooling: the same entries for the rows each sequence's pooling reads (flashllm.core.pooling)
    pooling: list[tuple[Sequence, int, int, int]] | None = None
    # the seq_id of each entry of cu_seqlens_q (a drafted decode has 1 + k entries): what hidden_sink reads
    seq_ids: list[int] | None = None


@dataclass(slots=True)
class _FlatBatch:
    """The host-side lists prepare() turns into tensors, one entry per token or per sequence."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sampling_rows: list[int] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    pooling: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)  # per q_lens entry, for models that read them
    state_slots: list[int] = field(default_factory=list)  # per q_lens entry: Sequence.state_slot


def _pad_to_buckets(flat: _FlatBatch, buckets: ShapeBuckets) -> None:
    """Pad `flat` in place to the buckets' sizes (the block-table width is padded by prepare).

    Padding tokens (token id 0, position 0, slot PAD_SLOT) follow the real ones and belong to no
    sequence: they sit past cu_seqlens_q[-1], whose rows the attention op leaves unspecified.
    Padding sequences have no tokens and no context (q_len = seq_len = 0, an empty block table).
    Logits rows are padded to the padded sequence count with row 0, so their number never
    depends on how many sequences sample this step.
    """
    num_tokens, num_seqs = len(flat.input_ids), len(flat.q_lens)
    pad_tokens = buckets.tokens(num_tokens) - num_tokens
    flat.input_ids.extend([0] * pad_tokens)
    flat.positions.extend([0] * pad_tokens)
    flat.slot_mapping.extend([PAD_SLOT] * pad_tokens)
    padded_seqs = buckets.seqs(num_seqs)
    flat.q_lens.extend([0] * (padded_seqs - num_seqs))
    flat.seq_lens.extend([0] * (padded_seqs - num_seqs))
    flat.prompt_lens.extend([0] * (padded_seqs - num_seqs))
    flat.state_slots.extend([-1] * (padded_seqs - num_seqs))
    flat.block_tables.extend([] for _ in range(padded_seqs - num_seqs))
    flat.sampling_rows.extend([0] * (padded_seqs - len(flat.sampling_rows)))


def _is_quantized(kv_dtype: torch.dtype) -> bool:
    # the 1-byte KV dtypes are the quantized ones (int8, float8_e4m3fn); the ops validate which
    return kv_dtype.itemsize == 1


class ModelRunner:
    """The generic runner: allocates `num_blocks` KV blocks per layer, runs the model on scheduled
    batches and samples their tokens.

    The model must provide `forward(input_ids, positions, kv_caches, attn_metadata)`,
    `compute_logits(hidden)` and `kv_cache_shape() -> (num_layers, num_kv_heads, head_dim)`.
    kv_caches holds one tuple per layer: (k_cache, v_cache) each (num_blocks, block_size, Hk, D)
    in kv_dtype; int8/fp8 caches add (k_scale, v_scale) float32: scale caches (num_blocks,
    block_size, Hk) with cachekv_int8_type "dynamic", or the layer's calibrated () / (Hk,)
    scales (the model's kv_cache_scales(), loaded from the checkpoint) with "static".
    cachekv_int8_type does not apply to float caches.
    A model with recurrent layers (CausalLM.state_cache_shapes) gets `num_state_slots` slots of each state
    tensor after the attention caches (allocate_kv_caches) and each sequence's slot in attn_metadata.state_slots.
    `adapter` (the selected device's DeviceAdapter; a do-nothing one by default) may ask for
    shape buckets, and its end_step() runs after every forward pass.

    The runner contract the engine and the executors use: `prepare_model` (once, before the KV
    cache is sized), `max_tokens_per_step`, `execute` (one scheduled batch -> the tokens of each
    sampling sequence, k >= 1 positions) and `execute_inputs` (a prepared batch, for the ranks
    that follow the driver under tensor parallelism). A backend may subclass it and name its
    class in `Backend.model_runner` to run its own fast paths (the cpu backend's runner does).
    """

    # whether multi-step calls (execute with max_steps > 1) hand every step's rows to hidden_sink; where they do
    # not, a drafter that reads hidden states keeps the steps of sequences it drafts for single
    bursts_feed_hidden_sink = False

    def __init__(
        self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
        cachekv_int8_type: str = "dynamic", adapter: DeviceAdapter | None = None, num_state_slots: int = 0,
    ) -> None:
        if cachekv_int8_type not in KV_SCALE_TYPES:
            raise ValueError(f"cachekv_int8_type {cachekv_int8_type!r} is not one of {KV_SCALE_TYPES}")
        self.model = model
        self._reads_prompt_lens = bool(getattr(model, "reads_prompt_lens", False))  # AttentionMetadata.prompt_lens
        self._keeps_state = bool(state_cache_specs(model))  # AttentionMetadata.state_slots
        self.device = device
        # the adapter's hooks: shape buckets (static-shape devices) and the end of each step
        self.adapter = adapter if adapter is not None else DeviceAdapter(device.type)
        self.shape_buckets = self.adapter.shape_buckets
        self.sampler = Sampler(self.argmax)
        self.graphs: DecodeGraphs | None = None  # captured decode steps (capture_graphs)
        # called with each step's prepared inputs before the forward pass: the executor's broadcast
        # of the batch to the other tensor-parallel ranks (None on one rank)
        self.on_inputs: Callable[[ModelInput], None] | None = None
        self.block_size = block_size
        self.lora: Any = None  # a flashllm.lora LoRAManager when multi-LoRA is on: prepare() sets each step's slots
        # called with each step's inputs and the model's (T, hidden) output before the head: a proposer that
        # drafts from the target's hidden states (core/spec/mtp.py); set, it keeps steps off device graphs
        self.hidden_sink: Callable[[ModelInput, torch.Tensor], None] | None = None
        self.kv_caches = allocate_kv_caches(model, device, num_blocks, block_size, kv_dtype, cachekv_int8_type,
                                            zeros=self.kv_zeros, num_state_slots=num_state_slots)

    @classmethod
    def place_empty_weights(cls, model: torch.nn.Module) -> None:
        """Once, after the model is built and before its weights load: parameters may be swapped for
        uninitialized ones of the same shapes in memory this runner prefers (loading fills them, so no
        copy is made later). The generic runner leaves them."""
        return None

    @classmethod
    def prepare_model(cls, model: torch.nn.Module, adapter: DeviceAdapter) -> None:
        """Once, after the model loaded and before the KV cache is sized: whatever this runner keeps
        beside the weights (re-laid weights, copies) is made here, so cache sizing sees its memory.
        The generic runner keeps nothing."""
        return None

    @staticmethod
    def kv_bytes_per_block(
        model: torch.nn.Module, block_size: int, kv_dtype: torch.dtype, cachekv_int8_type: str = "dynamic"
    ) -> int:
        """Bytes of K and V, over all layers, that one block of `block_size` tokens takes.

        Dynamic int8/fp8 caches also count their fp32 scale per (slot, head) for K and for V, so
        sizing by --kv-cache-memory stays honest; static scales are per layer, not per block.
        """
        num_layers, num_kv_heads, head_dim = model.kv_cache_shape()
        per_slot = num_kv_heads * head_dim * kv_dtype.itemsize
        if _is_quantized(kv_dtype) and cachekv_int8_type == "dynamic":
            per_slot += num_kv_heads * torch.float32.itemsize
        return _caches_per_layer(model) * num_layers * block_size * per_slot

    @staticmethod
    def state_bytes_per_slot(model: torch.nn.Module) -> int:
        """Bytes of recurrent state, over all layers, that one sequence's slot takes (0 for a model without)."""
        return sum(math.prod(shape) * dtype.itemsize for layer in state_cache_specs(model) for shape, dtype in layer)

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value, (B, V) -> (B,) int64; first on ties, NaN largest
        (torch's argmax). The sampler takes every token through it; a backend's runner may answer faster."""
        return rows.argmax(dim=-1)

    def max_tokens_per_step(self, states: list[SamplingState]) -> int:
        """The most tokens `execute` may return per sequence for a decode batch sampled with `states`
        (the engine grows the block tables to cover them before the call). The generic runner
        returns one token per step."""
        return 1

    def execute(self, batch: SchedulerOutput, states: list[SamplingState], max_steps: int = 1) -> list[SamplerOutput]:
        """Run the scheduled batch and sample: one SamplerOutput per new position (at most max_steps),
        each with a token for every sequence that samples, in batch order (states[i] is the i-th
        one's). Later positions exist only where the runner ran several steps; each is what a
        single step after the previous one would give. Empty when nothing samples."""
        drafts = [item.draft_token_ids for item in batch.scheduled if item.produces_token]
        # structured output: each grammar row's masks (a drafted one's for every verify row) are computed on a
        # CPU thread while the forward runs
        prefetch_masks([s.grammar for s in states], drafts)
        if any(drafts):
            return self._execute_drafted(batch, states, drafts)
        greedy = bool(states) and all(plain_greedy(s) for s in states)
        out = self.execute_model(batch, greedy=greedy)
        if not states:
            return []
        if greedy:
            return [SamplerOutput(out.tolist())]
        return [self.sampler(out, states)]

    def _execute_drafted(self, batch: SchedulerOutput, states: list[SamplingState],
                         drafts: list[list[int]]) -> list[SamplerOutput]:
        """A speculative round: the target scores every sequence's next token and drafts in one forward
        pass, and core/spec/verify.py keeps the accepted prefix of each plus one token of the target's."""
        greedy = all(plain_greedy(s) for s in verify.row_states(states, drafts))
        out = self.execute_model(batch, greedy=greedy)
        if greedy:
            verified = verify.accept_greedy_tokens(out.tolist(), drafts)
        else:
            verified = verify.verify(self.sampler, out, states, drafts)
        return verify.to_positions(verified)

    def prepare(self, batch: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into one varlen batch (read before Scheduler.update).

        With shape buckets, the batch is padded to them (see ShapeBuckets and _pad_to_buckets).
        """
        flat = self._flatten(batch)
        num_logits = None
        if self.shape_buckets is not None:
            num_logits = len(flat.sampling_rows)
            _pad_to_buckets(flat, self.shape_buckets)
        if self.lora is not None:
            self.lora.prepare([item.seq.lora_id for item in batch.scheduled],
                              [1 + len(item.draft_token_ids) if item.draft_token_ids else item.num_new_tokens
                               for item in batch.scheduled], len(flat.input_ids))
        width = max(len(t) for t in flat.block_tables)
        if self.shape_buckets is not None:
            width = self.shape_buckets.blocks(width)
        padded = [t + [0] * (width - len(t)) for t in flat.block_tables]
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(flat.slot_mapping, torch.int64),
            cu_seqlens_q=self._tensor([0, *accumulate(flat.q_lens)], torch.int32),
            seq_lens=self._tensor(flat.seq_lens, torch.int32),
            block_tables=self._tensor(padded, torch.int32),
            max_seqlen_q=max(flat.q_lens),
            max_seqlen_k=max(flat.seq_lens),
            prompt_lens=self._tensor(flat.prompt_lens, torch.int32) if self._reads_prompt_lens else None,
            state_slots=self._tensor(flat.state_slots, torch.int64) if self._keeps_state else None,
        )
        return ModelInput(
            input_ids=self._tensor(flat.input_ids, torch.int64),
            positions=self._tensor(flat.positions, torch.int64),
            attn_metadata=metadata,
            logits_indices=self._tensor(flat.sampling_rows, torch.int64),
            num_logits=num_logits,
            prompt_logprobs=flat.prompt_logprobs or None,
            prompt_logit_blocks=logit_blocks(flat.prompt_logprobs) or None,
            pooling=flat.pooling or None,
            seq_ids=flat.seq_ids,
        )

    def _flatten(self, batch: SchedulerOutput) -> _FlatBatch:
        flat = _FlatBatch()
        bs = self.block_size
        for item in batch.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            table = seq.block_table
            if item.draft_token_ids:
                self._flatten_drafted(flat, item.seq.token_ids[start], item.draft_token_ids, start, table)
                flat.prompt_lens.extend([seq.num_prompt_tokens] * (1 + len(item.draft_token_ids)))
                flat.seq_ids.extend([seq.seq_id] * (1 + len(item.draft_token_ids)))
                continue
            end = start + item.num_new_tokens
            flat.input_ids.extend(seq.token_ids[start:end])
            flat.positions.extend(range(start, end))
            flat.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            flat.prompt_logprobs.extend(prompt_logprob_rows(seq, len(flat.input_ids) - (end - start), start, end))
            flat.pooling.extend(pooling_rows(seq, len(flat.input_ids) - (end - start), start, end))
            flat.q_lens.append(item.num_new_tokens)
            flat.seq_ids.append(seq.seq_id)
            flat.seq_lens.append(end)
            flat.prompt_lens.append(seq.num_prompt_tokens)
            if self._keeps_state:
                flat.state_slots.append(seq.state_slot)
            flat.block_tables.append(table)
            if item.produces_token:
                flat.sampling_rows.append(len(flat.input_ids) - 1)
        return flat

    def _flatten_drafted(self, flat: _FlatBatch, token: int, drafts: list[int], start: int, table: list[int]) -> None:
        """A decode with drafts as 1 + k one-token rows over the same block table, row j attending to
        positions <= start + j: the same attention as one causal chunk of 1 + k tokens (every row's
        K and V are written before any row attends), but shaped as a decode batch, so each backend's
        decode paths (fused steps, device graphs) take verify rounds too. Every row samples."""
        bs = self.block_size
        for j, tok in enumerate((token, *drafts)):
            position = start + j
            flat.input_ids.append(tok)
            flat.positions.append(position)
            flat.slot_mapping.append(table[position // bs] * bs + position % bs)
            flat.q_lens.append(1)
            flat.seq_lens.append(position + 1)
            flat.block_tables.append(table)
            flat.sampling_rows.append(len(flat.input_ids) - 1)

    def kv_cache_bytes(self) -> int:
        """Bytes the allocated KV caches (and their scales) take over all layers."""
        return sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)

    def kv_zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed KV cache tensor (num_blocks, ...): allocate_kv_caches' factory. A backend's runner
        may back it lazily (the cpu runner maps pages only once written); the generic one is torch.zeros."""
        return torch.zeros(shape, dtype=dtype, device=device)

    releases_kv_memory = False  # whether release_kv_blocks gives memory back (the engine then calls it)

    def release_kv_blocks(self, block_ids: list[int]) -> None:
        """Free blocks whose KV content nothing needs any more (BlockManager.take_released): a runner
        whose cache memory follows use hands their memory back. The generic runner keeps its cache whole."""
        return None

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Record decode steps of up to max_num_seqs sequences as device graphs (see core/step_graphs.py).

        Call once the weights and KV caches are final: the graphs read them where they are now.
        """
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.adapter, self.device, self.block_size,
                                   max_model_len, graph_batch_sizes(max_num_seqs))
        self.graphs.capture()

    def _replay(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """The step's logits from a captured graph, or None when it is not a decode step a graph holds."""
        graphs = self.graphs
        if graphs is None or self.hidden_sink is not None or not all(item.num_new_tokens == 1 and item.produces_token for item in batch.scheduled):
            return None
        flat = self._flatten(batch)
        if not graphs.fits(len(flat.q_lens), max(len(t) for t in flat.block_tables)):
            return None
        with self.adapter.inference_mode():
            return graphs.run(flat.input_ids, flat.positions, flat.slot_mapping, flat.seq_lens, flat.block_tables)

    def execute_model(self, batch: SchedulerOutput, greedy: bool = False) -> torch.Tensor:
        """Run one step's forward pass; returns (N, vocab) fp32 logits for the sequences that sample,
        in order, or with `greedy` (every sampling row plain greedy) their (N,) int64 argmax tokens,
        which a backend's runner may find without computing the logits (_greedy_tokens)."""
        logits = self._replay(batch)
        if logits is not None:
            return self.argmax(logits) if greedy else logits
        return self.execute_inputs(self.prepare(batch), greedy)

    def execute_inputs(self, inputs: ModelInput, greedy: bool = False) -> torch.Tensor:
        """The forward pass of prepared inputs (see execute_model); every tensor-parallel rank runs
        it on the same inputs, which `on_inputs` sends to the others first."""
        if self.on_inputs is not None:
            self.on_inputs(inputs)
        with self.adapter.inference_mode():
            return self._execute(inputs, greedy)

    def _forward(self, inputs: ModelInput) -> torch.Tensor:
        """The model's hidden states for the step (a backend's runner may run a fused step instead)."""
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    def _greedy_tokens(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Tokens of plain greedy rows without their logits, or None (the generic runner has no such head)."""
        return None

    def greedy_head(self, head: Any) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        """A drafter's LM head (models/layers/embedding.py LMHead) as a function of its input rows (N, hidden)
        to their greedy tokens (N,) int64, first on ties, that skips the logits where it can and returns None
        for a call it does not take; None where the runner has no such path (the generic runner has none;
        the cpu backend's screens the head as its own greedy head does)."""
        return None

    def restrict_greedy_vocabulary(self, ids: list[int] | None) -> bool:
        """A drafter's hint: greedy tokens (execute_model(greedy=True), multi-step decode) may be the argmax over
        these token ids only (None: the whole vocabulary again). False where the runner keeps the whole
        vocabulary (the generic runner always does; the cpu backend's greedy head takes the hint)."""
        return False

    def _execute(self, inputs: ModelInput, greedy: bool = False) -> torch.Tensor:
        hidden = self._forward(inputs)
        if self.hidden_sink is not None:
            self.hidden_sink(inputs, hidden)
        if inputs.prompt_logprobs:
            record_prompt_logprobs(self.model, hidden, inputs.prompt_logprobs)
        elif inputs.prompt_logit_blocks:
            join_logit_gathers(self.model, hidden, inputs.prompt_logit_blocks)
        if inputs.pooling:
            record_pooled(hidden, inputs.pooling)
        if inputs.logits_indices.numel() == 0:
            self.adapter.end_step(self.device)
            return hidden.new_empty((0,) if greedy else (0, 0), dtype=torch.int64 if greedy else torch.float32)
        # every row samples (a decode step): its rows already are the logits' rows, in order, as
        # sampling rows only ever increase, so the gather is skipped
        every_row = inputs.num_logits is None and inputs.logits_indices.numel() == hidden.shape[0]
        rows = hidden if every_row else hidden[inputs.logits_indices]
        tokens = self._greedy_tokens(rows) if greedy else None
        if tokens is None:
            logits = self.model.compute_logits(rows).float()
            self.adapter.end_step(self.device)
            # sliced after end_step: inside the step's graph, each row count would be another graph
            logits = logits if inputs.num_logits is None else logits[: inputs.num_logits]
            return self.argmax(logits) if greedy else logits
        self.adapter.end_step(self.device)
        return tokens if inputs.num_logits is None else tokens[: inputs.num_logits]


def allocate_kv_caches(
    model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
    cachekv_int8_type: str = "dynamic", zeros: Callable[..., torch.Tensor] | None = None, num_state_slots: int = 0,
) -> list[tuple[torch.Tensor, ...]]:
    """One (k_cache, v_cache[, k_scale, v_scale]) tuple per attention layer, laid out as ModelRunner describes,
    then one tuple of zeroed (num_state_slots, *shape) state tensors per recurrent layer of a model that has them;
    `zeros(shape, dtype, device)` makes each zeroed KV cache (default torch.zeros; not the scales or states)."""
    states = [tuple(torch.zeros((num_state_slots, *shape), dtype=dtype, device=device) for shape, dtype in layer)
              for layer in state_cache_specs(model)]
    return _attention_caches(model, device, num_blocks, block_size, kv_dtype, cachekv_int8_type, zeros) + states


def state_cache_specs(model: torch.nn.Module) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
    """The model's recurrent-state (shape, dtype) per layer (CausalLM.state_cache_shapes); [] for one without."""
    shapes = getattr(model, "state_cache_shapes", None)  # a plugin's model may not derive from CausalLM
    return shapes() if shapes is not None else []


def _attention_caches(
    model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
    cachekv_int8_type: str, zeros: Callable[..., torch.Tensor] | None,
) -> list[tuple[torch.Tensor, ...]]:
    num_layers, num_kv_heads, head_dim = model.kv_cache_shape()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    make = zeros if zeros is not None else torch.zeros

    def cache() -> torch.Tensor:
        return make(shape, dtype=kv_dtype, device=device)

    per_layer = _caches_per_layer(model)
    if per_layer == 1:  # one cache a layer (MLA's latent cache): float only
        if _is_quantized(kv_dtype):
            raise ValueError(f"{type(model).__name__} keeps one latent cache per layer, which has no int8/fp8 form "
                             "yet; use --kv-cache-dtype auto (or a float dtype)")
        return [(cache(),) for _ in range(num_layers)]
    if not _is_quantized(kv_dtype):
        return [(cache(), cache()) for _ in range(num_layers)]
    if cachekv_int8_type == "dynamic":
        # unwritten slots are masked out but must still dequantize to finite values: code 0, scale 1
        def scales() -> torch.Tensor:
            return torch.ones(shape[:3], dtype=torch.float32, device=device)

        return [(cache(), cache(), scales(), scales()) for _ in range(num_layers)]
    return [(cache(), cache(), k_scale.to(device), v_scale.to(device))
            for k_scale, v_scale in static_kv_scales(model, num_layers)]


def _caches_per_layer(model: torch.nn.Module) -> int:
    """2 for (k_cache, v_cache) per layer, 1 for a model declaring one cache a layer (CausalLM.kv_caches_per_layer)."""
    return getattr(model, "kv_caches_per_layer", 2)


def static_kv_scales(model: torch.nn.Module, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's calibrated (k_scale, v_scale), in layer order; ValueError naming the first missing one."""
    layers = model.kv_cache_scales()
    if len(layers) != num_layers:
        raise ValueError(f"static KV cache scales: found {len(layers)} attention layers for {num_layers} KV caches")
    for index, (k_scale, v_scale) in enumerate(layers):
        if k_scale is None or v_scale is None:
            raise ValueError(
                f"--cachekv_int8_type static needs calibrated KV cache scales, but the checkpoint has none for "
                f"layer {index} (model.layers.{index}.self_attn.k_scale / v_scale): run `flashllm quantize ... "
                "--kv-scales` to add them, or use --cachekv_int8_type dynamic"
            )
    return layers
