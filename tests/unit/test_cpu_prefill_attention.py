"""The cpu backend's prefill attention (kernels._prefill_gqa) against the reference op."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu import kernels
from flashllm.ops.paged_attention import paged_attention as reference_attention

FP32 = {"rtol": 1e-5, "atol": 1e-5}  # flashllm/ops/tolerances.py for float32


def _causal_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention in float64, the last L of S positions querying: q (L, Hq, D), k / v (S, Hk, D)."""
    length, num_heads, _ = q.shape
    seq_len, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    kq, vq = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), kq) * scale
    visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - length, seq_len)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hls,shd->lhd", probs, vq)


@pytest.mark.parametrize("length,seq_len", [(2, 2), (7, 7), (65, 65), (200, 200), (5, 70), (33, 97)])
@pytest.mark.parametrize("heads", [(14, 2), (4, 4), (6, 3)])
@pytest.mark.parametrize("rows", [None, 5])
def test_prefill_gqa_matches_causal_attention(length, seq_len, heads, rows, monkeypatch) -> None:
    """Full prefills and chunks after a prefix, grouped and plain heads, in one chunk and in many."""
    if rows is not None:
        monkeypatch.setattr(kernels, "_MAX_QUERY_ROWS", rows)
    gen = torch.Generator().manual_seed(length * 1000 + seq_len)
    hq, hk = heads
    q = torch.randn(length, hq, 16, generator=gen)
    k, v = torch.randn(seq_len, hk, 16, generator=gen), torch.randn(seq_len, hk, 16, generator=gen)
    got = kernels._prefill_gqa(q, k, v, 0.3)
    torch.testing.assert_close(got.double(), _causal_float64(q, k, v, 0.3), **FP32)


def test_prefill_gqa_takes_empty_sequences() -> None:
    """A bucketed batch's padding slots have no queries and no keys."""
    got = kernels._prefill_gqa(torch.empty(0, 4, 16), torch.empty(0, 2, 16), torch.empty(0, 2, 16), 0.25)
    assert got.shape == (0, 4, 16)


def test_prefill_chunks_shrink_with_long_contexts(monkeypatch) -> None:
    """The score budget, not the row cap, sets the chunk for long contexts; the result is unchanged."""
    monkeypatch.setattr(kernels, "_SCORE_BYTES", 2 * 4 * 3 * 150)  # three query rows of 2 heads x 150 keys
    calls = []
    bmm = torch.bmm

    def counting_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(a.shape)
        return bmm(a, b)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 8, generator=gen) for n in (10, 150, 150))
    got = kernels._prefill_gqa(q, k, v, 0.5)
    assert [shape[1] for shape in calls[::2]] == [3, 3, 3, 1]  # 10 query rows, 3 a chunk
    torch.testing.assert_close(got.double(), _causal_float64(q, k, v, 0.5), **FP32)


def _paged_batch(dtype: torch.dtype):
    """A batch of a full prefill, a prefill chunk after a 40-token prefix and one decode token."""
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(16, 16, 2, 32, generator=gen).to(dtype)
    v_cache = torch.randn(16, 16, 2, 32, generator=gen).to(dtype)
    q_lens, seq_lens = [37, 9, 1], [37, 49, 20]
    tables = torch.tensor([[3, 0, 7, 0], [1, 5, 9, 12], [2, 4, 0, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 37, 46, 47], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 8, 32, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32)


def test_paged_prefill_takes_the_bmm_path_in_fp32(monkeypatch) -> None:
    """fp32 prefills (full and after a prefix) never reach SDPA and match the reference op."""
    def no_sdpa(*args, **kwargs):
        raise AssertionError("fp32 prefill reached scaled_dot_product_attention")

    batch = _paged_batch(torch.float32)
    want = reference_attention(*batch, 0.2)
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", no_sdpa)
    torch.testing.assert_close(kernels.paged_attention(*batch, 0.2), want, **FP32)


def test_paged_prefill_keeps_sdpa_for_half_precision(monkeypatch) -> None:
    """bf16 prefills stay on SDPA (its fp32 softmax), and still match the reference op."""
    calls = []
    sdpa = kernels.F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    batch = _paged_batch(torch.bfloat16)
    want = reference_attention(*batch, 0.2)
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", counting_sdpa)
    got = kernels.paged_attention(*batch, 0.2)
    assert len(calls) == 2  # the two prefills
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
