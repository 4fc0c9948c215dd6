"""The cpu backend's LoRA kernels on both of their paths (a few rows: every adapter in use in one batched
product; many rows: grouped by slot) against the reference ops, with unused slots and base rows."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu import lora as cpu_lora
from flashllm.ops.lora_expand import lora_expand as reference_expand
from flashllm.ops.lora_shrink import lora_shrink as reference_shrink
from flashllm.ops.tolerances import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, cpu_lora.DENSE_MAX_ROWS, cpu_lora.DENSE_MAX_ROWS + 72])
@pytest.mark.parametrize("pattern", ["mixed", "subset", "base_only", "one"])
def test_cpu_lora_kernels_match_the_reference(dtype, rows, pattern) -> None:
    gen = torch.Generator().manual_seed(rows)
    slots, rank, k, n_total, n, offset = 5, 16, 96, 80, 48, 24
    choices = {"mixed": [-1, 0, 1, 2, 3, 4], "subset": [-1, 1, 3], "base_only": [-1], "one": [2]}[pattern]
    indices = torch.tensor(choices)[torch.randint(0, len(choices), (rows,), generator=gen)]
    x = torch.randn(rows, k, generator=gen).to(dtype)
    lora_a = (torch.randn(slots, rank, k, generator=gen) * k**-0.5).to(dtype)
    lora_b = (torch.randn(slots, n, rank, generator=gen) * rank**-0.5).to(dtype)
    out = torch.randn(rows, n_total, generator=gen).to(dtype)
    h = cpu_lora.lora_shrink(x, lora_a, indices.clone())
    assert_close(h, reference_shrink(x, lora_a, indices), dtype)
    mine = cpu_lora.lora_expand(out.clone(), h, lora_b, indices.clone(), offset)
    expected = reference_expand(out.clone(), h, lora_b, indices, offset)
    assert_close(mine, expected, dtype)
    base_rows = indices < 0
    assert torch.equal(mine[base_rows], out[base_rows])  # rows without an adapter are untouched
    assert torch.equal(mine[:, :offset], out[:, :offset]) and torch.equal(mine[:, offset + n:], out[:, offset + n:])
