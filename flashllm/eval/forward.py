"""Full-window forwards for scoring: the engine's model over one token window, log-probs at every position."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashllm.config import CacheConfig
from flashllm.core.builder import EngineParts, build_engine_parts
from flashllm.models.hf_config import load_hf_config
from flashllm.models.layers.attention_metadata import AttentionMetadata

DEFAULT_MAX_LENGTH = 1024  # the context of the HF perplexity guide; --max-length overrides it
LOGITS_CHUNK_ROWS = 256    # logits rows materialised at once: 256 x 152k vocab x 4 B = 155 MB


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    """One engine configuration to score with: which model, on which device and backend, in which precision."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    backend: str | None = None
    quant_type: str | None = None
    kv_cache_dtype: str = "auto"
    group_size: int = -1
    quantize_lm_head: bool = False


def resolve_max_length(model_dir: str, max_length: int | None) -> int:
    """The window length to score with: `max_length`, or DEFAULT_MAX_LENGTH capped at the model's context.

    Checked against config.json's max_position_embeddings before any weight is loaded.
    """
    limit = load_hf_config(model_dir).max_position_embeddings
    if max_length is None:
        return min(DEFAULT_MAX_LENGTH, limit)
    if max_length > limit:
        raise ValueError(f"--max-length {max_length} exceeds the model's max_position_embeddings {limit}; "
                         f"pass --max-length {limit} or less")
    return max_length


def load_scoring_parts(config: ScoringConfig, max_length: int) -> EngineParts:
    """Build the engine's parts (device, op table, model, tokenizer) with a KV cache for one window.

    Scoring runs one sequence of at most `max_length` tokens at a time, so the cache holds
    exactly the blocks of one such window and nothing more.
    """
    from flashllm.llm import engine_config

    block_size = CacheConfig().block_size
    engine = engine_config(
        config.model, dtype=config.dtype, device=config.device, backend=config.backend,
        quant_type=config.quant_type, group_size=config.group_size, kv_cache_dtype=config.kv_cache_dtype,
        quantize_lm_head=config.quantize_lm_head or None, max_model_len=max_length, max_num_seqs=1,
        num_kv_blocks=math.ceil(max_length / block_size),
    )
    return build_engine_parts(engine)


def parts_dtype(parts: EngineParts) -> torch.dtype:
    """The floating-point dtype the loaded model computes in (its first floating parameter)."""
    for param in parts.model.parameters():
        if param.is_floating_point():
            return param.dtype
    raise ValueError("the loaded model has no floating-point parameter; cannot tell its compute dtype")


@torch.inference_mode()
def window_hidden(parts: EngineParts, token_ids: list[int], chunk_tokens: int | None = None) -> torch.Tensor:
    """Final hidden states of one window: (T,) token ids -> (T, hidden).

    The window runs as one prefill, or as chunked prefill steps of `chunk_tokens` tokens each
    attending to the cache the earlier chunks wrote: the kernels a decode batch of that many tokens
    takes (on the cpu backend, chunks of up to native.MAX_TOKENS run its native decode products).
    The window is one sequence whose blocks are 0..n-1 of the runner's cache, so slot p holds
    position p; whatever an earlier window wrote there is overwritten before attention reads it (and a
    recurrent model's state slot 0 starts from zeros at the window's first chunk).
    """
    runner = parts.runner
    num_tokens = len(token_ids)
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    num_blocks = math.ceil(num_tokens / runner.block_size)
    capacity = parts.num_blocks
    if num_blocks > capacity:
        raise ValueError(f"a window of {num_tokens} tokens needs {num_blocks} KV blocks but the cache holds "
                         f"{capacity}; build the parts with load_scoring_parts(config, max_length >= {num_tokens})")
    device = runner.device
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0)
    step = chunk_tokens or num_tokens
    hidden = []
    for start in range(0, num_tokens, step):
        end = min(start + step, num_tokens)
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=block_tables,
            max_seqlen_q=end - start,
            max_seqlen_k=end,
            prompt_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),  # the window is one prompt
            # a recurrent model carries the window's state from chunk to chunk in its first slot
            state_slots=torch.zeros(1, dtype=torch.int64, device=device) if parts.num_state_slots else None,
        )
        input_ids = torch.tensor(token_ids[start:end], dtype=torch.int64, device=device)
        positions = torch.arange(start, end, dtype=torch.int64, device=device)
        hidden.append(parts.model(input_ids, positions, runner.kv_caches, metadata))
    return hidden[0] if len(hidden) == 1 else torch.cat(hidden)


@torch.inference_mode()
def iter_logprobs(parts: EngineParts, hidden: torch.Tensor, rows: torch.Tensor,
                  chunk_rows: int = LOGITS_CHUNK_ROWS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Next-token log-probabilities at the given rows of a window, a chunk at a time.

    hidden (T, hidden) from window_hidden; rows (R,) int64 indices into it. Yields
    (rows of this chunk (r,), log_softmax of their logits (r, vocab) fp32) so that a large
    vocabulary never needs all R rows of logits at once.
    """
    for start in range(0, rows.numel(), chunk_rows):
        chunk = rows[start:start + chunk_rows]
        logits = parts.model.compute_logits(hidden[chunk.to(hidden.device)]).float()
        yield chunk, torch.log_softmax(logits, dim=-1)
