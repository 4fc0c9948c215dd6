"""Fixtures for model tests: tiny random models on disk, the reference op table, a paged-KV driver."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flashllm.backends.reference import reference_op_table
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.loader import load_model
from flashllm.models.registry import ModelRegistry
from flashllm.testing.loading import builtin_registry
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def ops():
    return reference_op_table()


@pytest.fixture
def model_registry() -> ModelRegistry:
    return builtin_registry()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """preset -> directory of a tiny random model (no tokenizer), built once per session."""
    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = build_tiny_model(tmp_path_factory.mktemp(preset), preset, seed=1, tokenizer=False)
        return built[preset]

    return get


@pytest.fixture(scope="session")
def loaded_pair(tiny_model_dir, ops) -> Callable[[str], tuple[torch.nn.Module, torch.nn.Module]]:
    """preset -> (flashllm model, transformers model), both float32 on CPU, loaded once."""
    from transformers import AutoModelForCausalLM

    registry = builtin_registry()
    pairs: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def get(preset: str):
        if preset not in pairs:
            model_dir = tiny_model_dir(preset)
            ours, _ = load_model(model_dir, ops, torch.float32, "cpu", registry, progress=False)
            theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            pairs[preset] = (ours, theirs)
        return pairs[preset]

    return get


class PagedDriver:
    """Runs a flashllm model over several sequences the way the engine would, by hand.

    Owns NaN-filled paged KV caches (so reading a slot never written poisons the output) and hands
    out physical blocks in a shuffled order, so block tables are never the identity.
    """

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int, seed: int = 0) -> None:
        num_layers, num_kv_heads, head_dim = model.kv_cache_shape()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.model, self.block_size = model, block_size
        per_layer = getattr(model, "kv_caches_per_layer", 2)  # MLA: one latent cache a layer
        self.kv_caches = [tuple(torch.full(shape, float("nan")) for _ in range(per_layer)) for _ in range(num_layers)]
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables: list[list[int]] = []
        self.num_tokens: list[int] = []

    def add_sequence(self) -> int:
        self.block_tables.append([])
        self.num_tokens.append(0)
        return len(self.num_tokens) - 1

    def _slot(self, seq: int, position: int) -> int:
        table = self.block_tables[seq]
        while len(table) <= position // self.block_size:
            table.append(self.free_blocks.pop())
        return table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed each (sequence, new tokens) chunk in one flat forward; return each chunk's logits (n, V)."""
        input_ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.num_tokens[seq]
            for i, token in enumerate(tokens):
                input_ids.append(token)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.num_tokens[seq] += len(tokens)
            q_lens.append(len(tokens))
            seq_lens.append(self.num_tokens[seq])
        tables = [self.block_tables[seq] for seq, _ in chunks]
        width = max(len(t) for t in tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, metadata)
        logits = self.model.compute_logits(hidden)
        return list(logits.split(q_lens))


@pytest.fixture
def paged_driver() -> type[PagedDriver]:
    return PagedDriver
