"""The native small ops (native_ops.py) against the portable reference bodies, and their refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.cpu import kernels, native, native_ops
from flashllm.ops.paged_attention import paged_attention as reference_attention
from flashllm.ops.rms_norm import rms_norm as reference_rms_norm
from flashllm.ops.rope_cache import build_cos_sin_cache
from flashllm.ops.rotary_embedding import rotary_embedding as reference_rotary
from flashllm.ops.silu_and_mul import silu_and_mul as reference_silu_and_mul
from flashllm.ops.write_kv_cache import write_kv_cache as reference_write

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")
FP32 = {"rtol": 1e-5, "atol": 1e-5}  # flashllm/ops/tolerances.py for float32


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, native_ops.MAX_NORM_ROWS])
def test_rms_norm(tokens: int, residual: bool) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x, weight = torch.randn(tokens, 96, generator=gen) * 3, torch.rand(96, generator=gen) + 0.5
    res = torch.randn(tokens, 96, generator=gen) if residual else None
    got = native_ops.rms_norm(x, weight, 1e-6, res)
    assert got is not None
    torch.testing.assert_close(got, reference_rms_norm(x, weight, 1e-6, res), **FP32)
    assert native_ops.rms_norm(x.double(), weight.double(), 1e-6) is None  # fp32 only
    wide = torch.rand(1024, generator=gen) + 0.5  # rows wider than a head: a decode batch's worth only
    assert native_ops.rms_norm(torch.randn(native_ops.MAX_NORM_ROWS, 1024), wide, 1e-6) is not None
    assert native_ops.rms_norm(torch.randn(native_ops.MAX_NORM_ROWS + 1, 1024), wide, 1e-6) is None


def test_per_head_norms_stay_native_for_a_decode_batch_of_heads() -> None:
    """Qwen3's q / k norms run (tokens x heads, head_dim): native up to HEAD_NORM_MAX_ROWS rows, so a
    token's heads are normed by the same code alone and beside others."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.rand(128, generator=gen) + 0.5
    rows = torch.randn(native_ops.HEAD_NORM_MAX_ROWS, 128, generator=gen)
    got = native_ops.rms_norm(rows, weight, 1e-6)
    assert got is not None
    torch.testing.assert_close(got, reference_rms_norm(rows, weight, 1e-6), **FP32)
    assert torch.equal(native_ops.rms_norm(rows[:16], weight, 1e-6), got[:16])  # row for row the same bits
    assert native_ops.rms_norm(torch.randn(native_ops.HEAD_NORM_MAX_ROWS + 1, 128), weight, 1e-6) is None


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 5), heads=st.sampled_from([(4, 2), (6, 1), (2, 2)]), head_dim=st.sampled_from([16, 64]),
       partial=st.booleans(), neox=st.booleans())
def test_rotary_matches_the_reference_on_fused_qkv_views(tokens, heads, head_dim, partial, neox) -> None:
    gen = torch.Generator().manual_seed(tokens * 31 + head_dim)
    hq, hk = heads
    rot = head_dim // 2 if partial else head_dim
    cache = build_cos_sin_cache(rot, 128, 10000.0)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen)  # q and k are strided views of it
    q, k = qkv[:, : hq * head_dim].view(tokens, hq, head_dim), qkv[:, hq * head_dim:(hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    want = reference_rotary(positions, q.clone(), k.clone(), cache, neox)
    got = kernels.rotary_embedding(positions, q, k, cache, neox)
    assert got[0].data_ptr() == q.data_ptr()  # rotated in place, through the native body
    torch.testing.assert_close(got, want, **FP32)


def test_rotary_leaves_out_of_range_positions_to_the_reference() -> None:
    cache = build_cos_sin_cache(16, 8, 10000.0)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    assert native_ops.rotary_embedding(torch.tensor([8]), q, k, cache, True) is None
    with pytest.raises(IndexError):
        kernels.rotary_embedding(torch.tensor([8]), q, k, cache, True)


def test_write_kv_cache_takes_float_caches_without_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([5, 17, 2])
    caches = [torch.zeros(4, 8, 2, 8) for _ in range(4)]
    assert native_ops.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference_write(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not native_ops.write_kv_cache(k, v, caches[0], caches[1], torch.tensor([5, -1, 2]))  # padding
    assert not native_ops.write_kv_cache(k, v, caches[0], caches[1], torch.tensor([5, 32, 2]))  # out of range
    with pytest.raises(ValueError, match="out of range"):
        kernels.write_kv_cache(k, v, caches[0], caches[1], torch.tensor([5, 32, 2]))


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_decode_attention_matches_the_reference(heads) -> None:
    gen = torch.Generator().manual_seed(1)
    hq, hk = heads
    k_cache, v_cache = torch.randn(12, 16, hk, 32, generator=gen), torch.randn(12, 16, hk, 32, generator=gen)
    seq_lens = torch.tensor([1, 37, 16, 70], dtype=torch.int32)  # one token, a partial block, a full one
    tables = torch.tensor([[3, 0, 0, 0, 0], [7, 1, 9, 0, 0], [2, 0, 0, 0, 0], [4, 5, 6, 8, 10]], dtype=torch.int32)
    cu = torch.arange(5, dtype=torch.int32)
    q = torch.randn(4, hq, 32, generator=gen)
    want = reference_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.17)
    torch.testing.assert_close(kernels.paged_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.17), want, **FP32)
    out = torch.zeros_like(q)
    assert native_ops.decode_attention(q, k_cache, v_cache, tables, [0, 1, 2, 3], [0, 1, 2, 3],
                                       seq_lens.tolist(), 0.17, out)
    torch.testing.assert_close(out, want, **FP32)


def _attention_case(seq_lens: list[int], hq: int, hk: int, head_dim: int, seed: int):
    """Random paged caches of 16-slot blocks, each sequence's blocks a shuffled set, the keys
    growing along the cache so a running maximum moves in later chunks and parts."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(seq_lens) // 16)
    blocks = len(seq_lens) * width + 1
    k_cache = torch.randn(blocks, 16, hk, head_dim, generator=gen) * torch.linspace(0.2, 2.0, blocks)[:, None, None, None]
    v_cache = torch.randn(blocks, 16, hk, head_dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[: len(seq_lens) * width].to(torch.int32).view(len(seq_lens), width)
    q = torch.randn(len(seq_lens), hq, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


# decode_attention.c cuts a context into parts of >= 64 slots while the batch has under 64
# (sequence, KV head) pairs, merges the parts' softmaxes, runs up to 8 query heads of a KV head
# together, takes 8 slots' scores at once (the rest one at a time, features past a multiple of 8
# one at a time), sums values 64 features at a time in registers, and runs the online softmax over
# 256-slot chunks within a part
@pytest.mark.parametrize("seq_lens,hq,hk,head_dim", [
    ([600, 1000], 8, 2, 32),          # 10 and 16 parts of one KV head's 4 query heads
    ([1, 7, 9, 64, 65], 6, 3, 16),    # single slots, a partial 8, a part's edge, two parts
    ([300] * 33, 4, 2, 32),           # 66 pairs: whole contexts over two 256-slot chunks each
    ([37, 130], 20, 2, 24),           # 10 query heads per KV head: 8, then 2
    ([45, 200], 4, 1, 12),            # features 8 + 4
    ([19, 70], 2, 2, 4),              # fewer features than a vector
    ([100, 7], 4, 2, 68),             # values 64 features in registers, then 4 one at a time
    ([90], 2, 1, 136),                # values 64 + 64 in registers, then one vector of 8
])
def test_decode_attention_matches_the_reference_across_its_splits(seq_lens, hq, hk, head_dim) -> None:
    q, k_cache, v_cache, tables, lens = _attention_case(seq_lens, hq, hk, head_dim, seed=len(seq_lens) + hq)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    want = reference_attention(q, k_cache, v_cache, tables, cu, lens, 0.3)
    out = torch.zeros_like(q)
    rows = list(range(len(seq_lens)))
    assert native_ops.decode_attention(q, k_cache, v_cache, tables, rows, rows, seq_lens, 0.3, out)
    torch.testing.assert_close(out, want, **FP32)


@pytest.mark.parametrize("length,positions", [
    # 300 slots and 40 sequences (80 pairs, whole contexts): every lane of the first 8, the first
    # chunk's last 8 and the second's first, the second chunk's scalar tail (44 = 5 x 8 + 4)
    (300, [*range(8), *range(248, 264), 292, 295, 296, 297, 298, 299, 1, 100, 150, 200, 201, 202, 203, 204, 205, 206]),
    (1000, [3, 500, 997]),  # parts: the key in the first, a middle and the last
])
def test_decode_attention_finds_a_dominant_key_wherever_it_sits(length: int, positions: list[int]) -> None:
    # the softmax subtracts each chunk's largest score: a key scoring hundreds above the rest, at
    # any slot, must take all the weight (the output is its value row); a maximum that misses the
    # key's slot overflows e^(score - maximum) to inf and the output to NaN
    q, k_cache, v_cache, tables, lens = _attention_case([length] * len(positions), 4, 2, 16, seed=length)
    q[:, 2:] = q[:, :2] = q[:, :1]  # one direction for every query head, so one key wins for all
    want = torch.empty_like(q)
    for b, pos in enumerate(positions):
        block, slot = int(tables[b, pos // 16]), pos % 16
        u = q[b, 0] / q[b, 0].norm()
        k_cache[block, slot, :] = 400.0 * u
        want[b] = v_cache[block, slot].repeat_interleave(2, dim=0)
    out = torch.zeros_like(q)
    rows = list(range(len(positions)))
    assert native_ops.decode_attention(q, k_cache, v_cache, tables, rows, rows, [length] * len(positions), 0.3, out)
    torch.testing.assert_close(out, want, **FP32)
    cu = torch.arange(len(positions) + 1, dtype=torch.int32)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, tables, cu, lens, 0.3), **FP32)


def test_decode_attention_does_not_depend_on_the_threads() -> None:
    # the parts follow the batch and the lengths only, so one thread and two give the same bits
    # (the fused decode step and the per-op path rely on it)
    seq_lens = [1000, 130]
    q, k_cache, v_cache, tables, lens = _attention_case(seq_lens, 8, 2, 32, seed=5)
    rows = torch.arange(2)
    outs = []
    for threads in (1, 2):
        out = torch.zeros_like(q)
        native.library().flashllm_decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), rows.data_ptr(), 2, 8, 2, 32, 16, 0.3, out.data_ptr(), threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], reference_attention(q, k_cache, v_cache, tables, torch.arange(3, dtype=torch.int32),
                                                            lens, 0.3), **FP32)


def test_decode_attention_refuses_tables_outside_the_cache() -> None:
    k_cache = v_cache = torch.randn(4, 16, 1, 32)
    q, out = torch.randn(1, 2, 32), torch.zeros(1, 2, 32)
    bad = torch.tensor([[4]], dtype=torch.int32)  # block 4 of a 4-block cache
    assert not native_ops.decode_attention(q, k_cache, v_cache, bad, [0], [0], [10], 0.1, out)
    too_long = torch.tensor([[1]], dtype=torch.int32)
    assert not native_ops.decode_attention(q, k_cache, v_cache, too_long, [0], [0], [17], 0.1, out)
    assert torch.equal(out, torch.zeros(1, 2, 32))


@pytest.mark.parametrize("tokens,inter", [(1, 13), (3, 64), (20, 4000)])  # the last splits over threads
def test_silu_and_mul_matches_the_reference(tokens: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(tokens, 2 * inter, generator=gen) * 6
    x[0, :4] = torch.tensor([100.0, -100.0, 88.5, -88.5])  # past the exp clamp on either side
    x[-1, 5] = float("nan")
    got = native_ops.silu_and_mul(x)
    assert got is not None and got.shape == (tokens, inter)
    torch.testing.assert_close(got, reference_silu_and_mul(x), equal_nan=True, **FP32)
    assert kernels.silu_and_mul(x.double()).dtype == torch.float64  # other dtypes: the portable body
    assert native_ops.silu_and_mul(x[:, 1:]) is None                  # not contiguous
    assert native_ops.silu_and_mul(torch.randn(2, 7)) is None         # odd width
