"""decode_attention.c's runs: one-token rows of one sequence (a verify step's 1 + k rows, lengths a row
apart over one block table) attended together must give every row the bits it gets alone; and any row,
in a batch of any size, the bits it gets in a batch of its own."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu import native
from flashllm.ops.paged_attention import paged_attention as reference_attention

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
FP32 = {"rtol": 1e-5, "atol": 1e-5}  # flashllm/ops/tolerances.py for float32
BLOCK = 16


def _verify_rows(sequences: list[tuple[int, int]], hk: int, head_dim: int, seed: int):
    """Caches and the rows of a decode batch where sequence i (context start L, rows R) gives R rows
    of lengths L, L + 1, ..., L + R - 1 over one block table, as ModelRunner._flatten_drafted builds them.
    Keys grow along the cache, so a running maximum moves in later chunks and parts."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(start + rows - 1) // BLOCK) for start, rows in sequences)
    blocks = len(sequences) * width + 1
    k_cache = torch.randn(blocks, BLOCK, hk, head_dim, generator=gen) * torch.linspace(0.2, 2.0, blocks)[:, None, None, None]
    v_cache = torch.randn(blocks, BLOCK, hk, head_dim, generator=gen)
    order = torch.randperm(blocks, generator=gen)[: len(sequences) * width].to(torch.int32).view(len(sequences), width)
    tables = torch.cat([order[i].expand(rows, width) for i, (_, rows) in enumerate(sequences)]).contiguous()
    lens = torch.tensor([start + j for start, rows in sequences for j in range(rows)], dtype=torch.int32)
    return k_cache, v_cache, tables, lens


def _own_copies(k_cache, v_cache, tables, lens):
    """The same rows with each one's blocks copied to a cache region of its own (so no two rows share
    a table and the kernel takes every row alone), the batch and the lengths unchanged."""
    width = tables.shape[1]
    k = torch.cat([k_cache[tables[b]] for b in range(len(lens))])
    v = torch.cat([v_cache[tables[b]] for b in range(len(lens))])
    own = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    return k.contiguous(), v.contiguous(), own, lens


def _attend(q, k_cache, v_cache, tables, lens, threads: int) -> torch.Tensor:
    out = torch.zeros_like(q)
    hq, hk, d = q.shape[1], k_cache.shape[2], q.shape[2]
    rows = torch.arange(len(lens))
    native.library().flashllm_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), rows.data_ptr(), len(lens), hq, hk, d, BLOCK, 0.3, out.data_ptr(), threads)
    return out


@pytest.mark.parametrize("sequences,hq,hk,head_dim", [
    ([(400, 9)], 9, 3, 64),                 # SmolLM2's heads, a k = 8 verify step: two parts a row
    ([(400, 5)], 14, 2, 64),                # qwen2.5-0.5b's heads, k = 4: six parts a row
    ([(60, 9)], 9, 3, 64),                  # rows across the first part's edge (64 slots): one part, then two
    ([(250, 9), (1000, 2)], 8, 2, 32),      # two sequences; chunk edges (256) inside the run's parts
    ([(3, 1), (97, 4), (10, 1)], 6, 3, 20),  # a run between single rows; 16 + 4 features
    ([(1, 9)], 4, 1, 12),                   # from a one-slot context: scalar tails in every row
    ([(500, 20)], 20, 2, 68),               # more rows than a run takes (16); 10 query heads: 8, then 2
    ([(33, 3)] * 30, 4, 2, 16),             # 90 rows, 180 pairs: whole contexts, no parts
])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_one_sequence_get_the_bits_they_get_alone(sequences, hq, hk, head_dim, threads) -> None:
    k_cache, v_cache, tables, lens = _verify_rows(sequences, hk, head_dim, seed=hq + len(sequences))
    q = torch.randn(len(lens), hq, head_dim, generator=torch.Generator().manual_seed(7))
    lib = native.library()
    taken = lib.flashllm_attention_runs_taken()
    together = _attend(q, k_cache, v_cache, tables, lens, threads)
    assert lib.flashllm_attention_runs_taken() == taken + 1  # the rows were recognised as runs
    alone = _attend(q, *_own_copies(k_cache, v_cache, tables, lens), threads)
    assert lib.flashllm_attention_runs_taken() == taken + 1  # own tables: every row alone
    assert torch.equal(together, alone)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    torch.testing.assert_close(together, reference_attention(q, k_cache, v_cache, tables, cu, lens, 0.3), **FP32)


def test_the_switch_runs_rows_alone_with_the_same_bits() -> None:
    k_cache, v_cache, tables, lens = _verify_rows([(300, 9)], 3, 64, seed=3)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(1))
    lib = native.library()
    default = lib.flashllm_attention_set_run_rows(-1)
    try:
        together = _attend(q, k_cache, v_cache, tables, lens, 2)
        assert lib.flashllm_attention_set_run_rows(1) == 1
        taken = lib.flashllm_attention_runs_taken()
        alone = _attend(q, k_cache, v_cache, tables, lens, 2)
        assert lib.flashllm_attention_runs_taken() == taken
    finally:
        lib.flashllm_attention_set_run_rows(default)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("change", ["lengths", "table"])
def test_rows_that_are_not_one_sequence_are_not_a_run(change: str) -> None:
    k_cache, v_cache, tables, lens = _verify_rows([(200, 4)], 2, 32, seed=4)
    if change == "lengths":
        lens = torch.tensor([200, 202, 204, 206], dtype=torch.int32)  # one table, lengths two apart
    else:
        tables[1::2, 5] = (tables[0, 5] + 1) % k_cache.shape[0]  # every other row: another block in its context
    q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(2))
    lib = native.library()
    taken = lib.flashllm_attention_runs_taken()
    out = _attend(q, k_cache, v_cache, tables, lens, 1)
    assert lib.flashllm_attention_runs_taken() == taken
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, tables, cu, lens, 0.3), **FP32)


@pytest.mark.parametrize("sequences,hq,hk,head_dim", [
    ([(171, 5), (166, 1), (155, 1), (226, 1)], 9, 3, 64),  # a verify step beside three decodes (SmolLM2's heads)
    ([(200, 1)] * 4 + [(900, 1)] * 4, 14, 2, 64),           # 8 decodes, long and short (qwen2.5-0.5b's heads)
    ([(33, 3)] * 30 + [(700, 2)], 4, 2, 16),                # 92 rows: a large batch with a long context in it
])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_batch(sequences, hq, hk, head_dim, threads) -> None:
    """How a row's context is cut into parts (and so its bits) depends on its length only. It once depended on
    the batch's size too, and the int8-rounded products of a GGUF model turned that last bit into other tokens
    for a request in a batch than alone."""
    k_cache, v_cache, tables, lens = _verify_rows(sequences, hk, head_dim, seed=hq + len(sequences))
    q = torch.randn(len(lens), hq, head_dim, generator=torch.Generator().manual_seed(5))
    together = _attend(q, k_cache, v_cache, tables, lens, threads)
    for b in range(len(lens)):
        alone = _attend(q[b:b + 1].clone(), k_cache, v_cache, tables[b:b + 1].clone(), lens[b:b + 1].clone(), threads)
        assert torch.equal(together[b:b + 1], alone), b
