"""paged_attention and write_kv_cache vs dense causal attention over an unpaged copy of the cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.ops.paged_attention import paged_attention
from flashllm.ops.testing import random_block_tables
from flashllm.ops.tolerances import assert_close
from flashllm.ops.write_kv_cache import write_kv_cache

GQA = [(4, 4), (4, 2), (8, 2), (7, 1)]  # (Hq, Hk): ratios 1, 2, 4, 7


def _build_batch(q_lens, seq_lens, heads, kv_heads, dim, block_size, dtype, seed=0):
    """Dense per-sequence K/V scattered token by token into a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(gen, seq_lens, block_size)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    dense_k, dense_v = [], []
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        for i in range(n):
            block, offset = int(tables[b, i // block_size]), i % block_size
            k_cache[block, offset], v_cache[block, offset] = k[i], v[i]
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + [sum(q_lens[: b + 1]) for b in range(len(q_lens))], dtype=torch.int32)
    args = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=1 / math.sqrt(dim),
    )
    return args, dense_k, dense_v


def _dense_attention(q, dense_k, dense_v, q_lens, scale, alibi_slopes=None, sliding_window=None):
    """fp64 SDPA per sequence with an explicit additive mask; K/V heads repeated for GQA."""
    outputs, start = [], 0
    for k, v, q_len in zip(dense_k, dense_v, q_lens, strict=True):
        seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
        qs = q[start : start + q_len].double().transpose(0, 1)  # (Hq, q_len, D)
        ks = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
        k_pos = torch.arange(seq_len).view(1, -1)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed = allowed & (q_pos - k_pos < sliding_window)
        mask = torch.where(allowed, 0.0, -math.inf).double().expand(q.shape[1], -1, -1)
        if alibi_slopes is not None:
            mask = mask + alibi_slopes.double().view(-1, 1, 1) * (k_pos - q_pos).double()
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outputs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outputs).to(q.dtype)


def _check(q_lens, seq_lens, heads, kv_heads, dim, block_size, dtype=torch.float32, **extra):
    args, dense_k, dense_v = _build_batch(q_lens, seq_lens, heads, kv_heads, dim, block_size, dtype)
    out = paged_attention(**args, **extra)
    expected = _dense_attention(args["q"], dense_k, dense_v, q_lens, args["scale"], **extra)
    assert out.shape == args["q"].shape and out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_decode_and_mixed_batches(block_size: int, heads: int, kv_heads: int) -> None:
    bs = block_size
    layouts = [
        ([bs + 3], [bs + 3]),  # one prefill crossing a block edge
        ([bs, 2 * bs], [bs, 2 * bs]),  # prefills ending exactly at block edges
        ([7, bs + 1], [2 * bs + 5, 3 * bs + 1]),  # prefill after a cached prefix
        ([1, 1, 1, 1], [1, bs, bs + 1, 2 * bs - 1]),  # decode at and across edges
        ([bs - 1, 1, 5, 3], [bs - 1, 2 * bs + 1, 5, bs + 2]),  # mixed
    ]
    for q_lens, seq_lens in layouts:
        _check(q_lens, seq_lens, heads, kv_heads, 16, block_size)


@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_sliding_window(window: int) -> None:
    _check([20, 1, 9], [20, 40, 33], 8, 2, 16, 16, sliding_window=window)


def test_alibi() -> None:
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(8)])
    _check([17, 1, 4], [17, 30, 64], 8, 4, 16, 16, alibi_slopes=slopes)
    _check([9], [70], 8, 8, 16, 64, alibi_slopes=slopes, sliding_window=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_contract(dtype: torch.dtype) -> None:
    _check([5, 1], [21, 16], 4, 2, 32, 16, dtype=dtype)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([16, 64]),
    gqa=st.sampled_from(GQA),
    num_seqs=st.integers(1, 4),
)
def test_random_layouts(data, block_size: int, gqa: tuple[int, int], num_seqs: int) -> None:
    seq_lens = data.draw(st.lists(st.integers(1, 150), min_size=num_seqs, max_size=num_seqs))
    q_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    window = data.draw(st.none() | st.integers(1, 200))
    _check(q_lens, seq_lens, gqa[0], gqa[1], 8, block_size, sliding_window=window)


def test_chunked_prefill_equals_full_prefill() -> None:
    args, _, _ = _build_batch([50], [50], 4, 2, 16, 16, torch.float32)
    full = paged_attention(**args)
    start = 0
    for chunk in (17, 16, 1, 16):  # chunks ending mid-block and on a block edge
        end = start + chunk
        part = paged_attention(
            **{
                **args,
                "q": args["q"][start:end],
                "cu_seqlens_q": torch.tensor([0, chunk], dtype=torch.int32),
                "seq_lens": torch.tensor([end], dtype=torch.int32),
            }
        )
        torch.testing.assert_close(part, full[start:end])
        start = end


def test_slots_outside_the_context_are_never_read() -> None:
    args, dense_k, dense_v = _build_batch([3, 1], [19, 33], 4, 2, 16, 16, torch.float32)
    poisoned = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    used = torch.zeros(poisoned["k_cache"].shape[:2], dtype=torch.bool)
    for b, n in enumerate([19, 33]):
        for i in range(n):
            used[args["block_tables"][b, i // 16], i % 16] = True
    for cache in poisoned.values():
        cache[~used] = float("nan")
    out = paged_attention(**{**args, **poisoned})
    torch.testing.assert_close(out, paged_attention(**args))


def test_rejects_bad_layouts_and_quantized_caches() -> None:
    args, _, _ = _build_batch([3], [5], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="seq_lens must include"):
        paged_attention(**{**args, "seq_lens": torch.tensor([2], dtype=torch.int32)})
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(**{**args, "q": torch.randn(3, 3, 16)})
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(**args, k_scale=torch.ones(1))
    int8_cache = args["k_cache"].to(torch.int8)
    with pytest.raises(ValueError, match="int8"):
        paged_attention(**{**args, "k_cache": int8_cache, "v_cache": int8_cache})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_cache_matches_slot_loop(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, dim = 6, 16, 2, 8
    last_slot = num_blocks * block_size - 1
    slots = torch.randperm(last_slot - 1, generator=gen)[:21] + 1
    slots[[1, 9]] = torch.tensor([0, last_slot])  # the first and the last slot of the pool
    slots[[0, 7, 20]] = -1  # padding tokens
    k = torch.randn(21, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(21, kv_heads, dim, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot != -1:
            expected_k[slot // block_size, slot % block_size] = k[t]
            expected_v[slot // block_size, slot % block_size] = v[t]
    assert write_kv_cache(k, v, k_cache, v_cache, slots) is None
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_cache_rejects_scales_fp8_and_out_of_range_slots() -> None:
    k = torch.randn(2, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="v_scale"):
        write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 1]), v_scale=torch.ones(1))
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        write_kv_cache(k, k, fp8, fp8, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 8]))
