"""Checks shared by the Mamba-2 family's tests (Mamba-2, Bamba, Granite 4.0-H): a tiny checkpoint beside its
transformers model, and the hand-driven paged forward with each sequence's states in a slot of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashllm.testing.parity import (
    check_chunked_prefill_beside_a_decode,
    check_varlen_prefill_and_decode,
    random_tokens,
)
from flashllm.testing.state_slots import WithStateSlots
from flashllm.testing.tiny_models import build_tiny_model


def reference_pair(out_dir: Path, preset: str, seed: int, **overrides: Any) -> tuple[Path, torch.nn.Module]:
    """A tiny float32 checkpoint of `preset` (build_tiny_model, no tokenizer, `overrides` on its config) and
    transformers' model loaded from it."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(out_dir, preset, seed=seed, tokenizer=False, **overrides)
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_paged_states(ours: Any, theirs: torch.nn.Module, driver_class: Any, vocab_size: int) -> None:
    """A varlen prefill of prompts of 1 to 70 tokens then decodes of all of them together, and a 150-token prompt in
    chunks beside another sequence's decodes (tests/models/conftest.py's PagedDriver with NaN-filled state slots):
    every logits row within 1e-4 of transformers' full forward."""
    prompts = [random_tokens(n, vocab_size, seed=n) for n in (1, 2, 3, 17, 70)]
    check_varlen_prefill_and_decode(driver_class(WithStateSlots(ours, 64), block_size=16, num_blocks=64, seed=3),
                                    theirs, prompts)
    check_chunked_prefill_beside_a_decode(driver_class(WithStateSlots(ours, 32), block_size=16, num_blocks=32, seed=5),
                                          theirs, vocab_size)
