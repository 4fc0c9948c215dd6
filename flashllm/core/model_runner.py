"""ModelRunner: owns the paged KV cache and turns a scheduled batch into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from flashllm.core.scheduler import SchedulerOutput
from flashllm.models.layers.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class ModelInput:
    """The flat batch of one step.

    input_ids, positions: (T,) int64 over all scheduled tokens, sequence after sequence.
    logits_indices:       (N,) int64, the last token of each sequence that samples this step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


class ModelRunner:
    """Allocates `num_blocks` KV blocks per layer and runs the model on scheduled batches.

    The model must provide `forward(input_ids, positions, kv_caches, attn_metadata)`,
    `compute_logits(hidden)` and `kv_cache_shape() -> (num_layers, num_kv_heads, head_dim)`.
    """

    def __init__(
        self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int, kv_dtype: torch.dtype
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        num_layers, num_kv_heads, head_dim = model.kv_cache_shape()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(num_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of K and V, over all layers, that one block of `block_size` tokens takes."""
        num_layers, num_kv_heads, head_dim = model.kv_cache_shape()
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def prepare(self, batch: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into one varlen batch (read before Scheduler.update)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sampling_rows: list[int] = []
        bs = self.block_size
        for item in batch.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            q_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(table)
            if item.produces_token:
                sampling_rows.append(len(input_ids) - 1)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            cu_seqlens_q=self._tensor([0, *accumulate(q_lens)], torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(padded, torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
        )
        return ModelInput(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            attn_metadata=metadata,
            logits_indices=self._tensor(sampling_rows, torch.int64),
        )

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns (N, vocab) fp32 logits for the sequences that sample, in order."""
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if inputs.logits_indices.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()
