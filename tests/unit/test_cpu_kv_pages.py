"""The cpu KV cache's lazily backed pages: zero-reading, resident only where written, released per block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashllm.backends.cpu import kv_pages
from flashllm.backends.cpu.kv_pages import PAGE, KVPages, block_runs, inner_pages
from flashllm.testing.pages import backed_pages

pytestmark = pytest.mark.skipif(not kv_pages.enabled(), reason="lazily backed KV pages need Linux")


@given(st.lists(st.integers(0, 40), max_size=30))
def test_block_runs_cover_exactly_the_ids(ids):
    runs = block_runs(ids)
    covered = [b for start, end in runs for b in range(start, end)]
    assert covered == sorted(set(ids))
    assert all(end < nxt for (_, end), (nxt, _) in zip(runs, runs[1:], strict=False))  # maximal: gaps between


@given(st.integers(0, 10 * PAGE), st.integers(0, 10 * PAGE))
def test_inner_pages_are_whole_pages_inside_the_range(a, b):
    start, end = min(a, b), max(a, b)
    offset, length = inner_pages(start, end)
    assert offset % PAGE == 0 and length % PAGE == 0 and length >= 0
    if length:
        assert start <= offset and offset + length <= end
    whole = [p for p in range(0, 11 * PAGE, PAGE) if start <= p and p + PAGE <= end]
    assert length == len(whole) * PAGE


def test_cache_reads_zeros_and_is_resident_only_where_written():
    pages = KVPages()
    cache = pages.zeros((64, 8, 2, 64), torch.float32, "cpu")  # blocks of 8 x 2 x 64 x 4 B = one page
    assert cache.shape == (64, 8, 2, 64) and cache.dtype == torch.float32
    assert backed_pages(cache) == 0
    assert torch.count_nonzero(cache) == 0  # reading maps the shared zero page, nothing resident
    assert backed_pages(cache) == 0
    cache[3].fill_(1.0)
    cache[10:12].fill_(2.0)
    assert backed_pages(cache) == 3 * PAGE == pages.resident_bytes()


def test_release_drops_the_pages_of_freed_blocks_and_keeps_the_rest():
    pages = KVPages()
    k = pages.zeros((32, 16, 2, 64), torch.float32, "cpu")  # 2 pages a block
    v = pages.zeros((32, 16, 2, 64), torch.float32, "cpu")
    torch.manual_seed(0)
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    kept_k, kept_v = k.clone(), v.clone()
    assert backed_pages(k, v) == 2 * 32 * 2 * PAGE
    advised = pages.release([5, 6, 7, 20])
    assert advised == 2 * 4 * 2 * PAGE
    assert backed_pages(k, v) == 2 * 28 * 2 * PAGE == pages.resident_bytes()
    freed = [5, 6, 7, 20]
    kept = [b for b in range(32) if b not in freed]
    assert torch.equal(k[kept], kept_k[kept]) and torch.equal(v[kept], kept_v[kept])
    assert torch.count_nonzero(k[freed]) == 0 and torch.count_nonzero(v[freed]) == 0
    k[6].fill_(3.0)  # a reused block is backed again and holds what was written
    assert torch.all(k[6] == 3.0) and backed_pages(k, v) == (29 + 28) * 2 * PAGE


def test_release_of_blocks_smaller_than_a_page_never_drops_a_neighbour_in_use():
    pages = KVPages()
    per_page = PAGE // (4 * 2 * 16 * 4)  # blocks of 4 x 2 x 16 fp32: 512 B, 8 to a page
    cache = pages.zeros((4 * per_page, 4, 2, 16), torch.float32, "cpu")
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape) + 1)
    before = cache.clone()
    pages.release(range(1, per_page))  # every block of page 0 but block 0, and all of none other
    pages.release(range(per_page, 2 * per_page))  # the whole of page 1
    assert torch.equal(cache[0], before[0])
    assert torch.count_nonzero(cache[per_page : 2 * per_page]) == 0
    assert torch.equal(cache[2 * per_page :], before[2 * per_page :])
    assert backed_pages(cache) == 3 * PAGE


def test_resident_bytes_counts_its_own_caches_only():
    """Two runners' caches, mapped one after the other with the same flags, may be one kernel mapping
    (smaps would then give each the other's pages too): each counts the pages of its own addresses."""
    busy, idle = KVPages(), KVPages()
    written = busy.zeros((16, 8, 2, 64), torch.float32, "cpu")  # one page a block
    untouched = idle.zeros((16, 8, 2, 64), torch.float32, "cpu")
    written.fill_(1.0)
    assert busy.resident_bytes() == backed_pages(written) == 16 * PAGE
    assert idle.resident_bytes() == backed_pages(untouched) == 0


def test_switched_off_the_cache_is_torch_zeros(monkeypatch):
    monkeypatch.setenv(kv_pages.ENV_SWITCH, "0")
    pages = KVPages()
    cache = pages.zeros((4, 8, 2, 64), torch.float32, "cpu")
    assert torch.count_nonzero(cache) == 0 and pages.release([0, 1]) == 0 and pages.resident_bytes() == 0
