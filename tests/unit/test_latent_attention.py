"""latent_attention's reference (both forms) and the cpu kernel against an independent oracle: keys and values
materialized per head from the latents, then dense causal attention in float64 on the unpaged context."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu.mla import latent_attention as cpu_latent_attention
from flashllm.backends.xla.mla import latent_attention as xla_latent_attention
from flashllm.ops.latent_attention import latent_attention
from flashllm.ops.testing import cases, make_inputs


def oracle(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (T, H, Dv) float64, the cache after the write) computed without the paged layout or the op's code."""
    q, latent, cache = inputs["q"].double(), inputs["latent"].double(), inputs["kv_cache"].double().clone()
    w = inputs["kv_b_weight"].double()
    heads, _, rank = w.shape
    rope = cache.shape[-1] - rank
    nope = q.shape[-1] - rope
    block_size = cache.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    for t, slot in enumerate(inputs["slot_mapping"].tolist()):
        if slot >= 0:
            flat[slot] = latent[t]
    out = torch.zeros(q.shape[0], heads, w.shape[1] - nope, dtype=torch.float64)
    starts = inputs["cu_seqlens_q"].tolist()
    for b, seq_len in enumerate(inputs["seq_lens"].tolist()):
        slots = [int(inputs["block_tables"][b, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        context = flat[slots]  # (S, L + R), in position order
        keys = torch.cat([torch.cat([context[:, :rank] @ w[h, :nope].T, context[:, rank:]], dim=-1)[None]
                          for h in range(heads)])  # (H, S, Dn + R)
        values = torch.stack([context[:, :rank] @ w[h, nope:].T for h in range(heads)])  # (H, S, Dv)
        start, end = starts[b], starts[b + 1]
        for i in range(end - start):
            position = seq_len - (end - start) + i
            scores = torch.einsum("hd,hsd->hs", q[start + i], keys[:, : position + 1]) * inputs["scale"]
            out[start + i] = torch.einsum("hs,hsd->hd", torch.softmax(scores, -1), values[:, : position + 1])
    return out, flat.view_as(cache)


@pytest.mark.parametrize("fn", [latent_attention, cpu_latent_attention, xla_latent_attention],
                         ids=["reference", "cpu", "xla-on-cpu"])
@pytest.mark.parametrize("case", list(cases("latent_attention")))
def test_latent_attention_matches_the_materialized_oracle(fn, case) -> None:
    inputs = make_inputs("latent_attention", torch.float32, case=case)
    expected, cache = oracle(inputs)
    for absorbed in (True, False):
        args = {**inputs, "kv_cache": inputs["kv_cache"].clone(), "absorbed": absorbed}
        out = fn(**args)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(args["kv_cache"].double(), cache, atol=0, rtol=0)


def test_a_padding_slot_keeps_its_cached_row() -> None:
    inputs = make_inputs("latent_attention", torch.float32, case="cached_prefix_with_padding")
    cache = inputs["kv_cache"].clone()
    latent_attention(**inputs)
    flat, before = inputs["kv_cache"].view(-1, cache.shape[-1]), cache.view(-1, cache.shape[-1])
    written = set(inputs["slot_mapping"][inputs["slot_mapping"] >= 0].tolist())
    untouched = [s for s in range(flat.shape[0]) if s not in written]
    assert torch.equal(flat[untouched], before[untouched])


@pytest.mark.parametrize("fn", [latent_attention, cpu_latent_attention], ids=["reference", "cpu"])
def test_bad_inputs_are_refused_saying_what_was_expected(fn) -> None:
    inputs = make_inputs("latent_attention", torch.float32, case="decode")
    with pytest.raises(ValueError, match="only float caches"):
        fn(**{**inputs, "kv_cache": inputs["kv_cache"].to(torch.int8)})
    with pytest.raises(ValueError, match="expected q_len <= seq_len"):
        fn(**{**inputs, "seq_lens": torch.zeros_like(inputs["seq_lens"])})
    with pytest.raises(ValueError, match=r"kv_b_weight \(H, Dn \+ Dv, L\)"):
        fn(**{**inputs, "kv_b_weight": inputs["kv_b_weight"][:-1]})  # one head fewer than q


@pytest.mark.parametrize("dims", [(5, 64, 16, 32, 48), (3, 20, 6, 13, 11), (16, 512, 64, 128, 128)],
                         ids=["conformance", "odd", "v2-lite"])
def test_cpu_decode_batches_take_the_native_absorbed_path_and_match_the_oracle(dims, monkeypatch) -> None:
    """One token a sequence, absorbed: the per-head W_UK / W_UV products and the attention run native
    (the torch path is made to fail), odd sizes included (tails of the vector loops)."""
    from flashllm.backends.cpu import mla, native
    from flashllm.ops import testing_latent

    if native.library() is None:
        pytest.skip(f"no native cpu kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(testing_latent, "LATENT_DIMS", dims)
    monkeypatch.setattr(mla, "_absorbed", lambda *a: pytest.fail("a decode batch took the torch path"))
    inputs = testing_latent.latent_attention_inputs(torch.Generator().manual_seed(7), torch.float32, "cpu", 0, 16,
                                                    "decode")
    expected, cache = oracle(inputs)
    out = cpu_latent_attention(**inputs)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(inputs["kv_cache"].double(), cache, atol=0, rtol=0)
