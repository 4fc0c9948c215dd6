"""Prefill attention at 2048 tokens: the Triton paged kernel against torch SDPA's flash path (bf16, H100).

    python benchmarks/gpu/prefill_vs_sdpa.py

One sequence of 2048 new tokens (32 query heads, 8 KV heads, head 128, block 64) written to the
paged cache, and the same q/k/v contiguous for SDPA (causal, K/V heads repeated to 32: flash
needs equal head counts). Checked against each other first; times are do_bench medians.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashllm.backends.cuda.triton_attention import paged_attention

# (rows per tile, warps, stages) of the Triton prefill kernel
TILES = [(64, 4, 2), (64, 8, 3), (128, 4, 3), (128, 8, 2), (128, 8, 3), (128, 8, 4), (256, 8, 3)]


def main() -> None:
    tokens, hq, hk, d, bs = 2048, 32, 8, 128, 64
    dev = "cuda"
    q = torch.randn(tokens, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(tokens, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(tokens, hk, d, device=dev, dtype=torch.bfloat16)
    blocks = tokens // bs
    k_cache = k.view(blocks, bs, hk, d).contiguous()
    v_cache = v.view(blocks, bs, hk, d).contiguous()
    tables = torch.arange(blocks, dtype=torch.int32, device=dev).view(1, -1)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    lens = torch.tensor([tokens], dtype=torch.int32, device=dev)
    scale = d**-0.5

    def triton_run() -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, tables, cu, lens, scale)

    qs = q.transpose(0, 1).unsqueeze(0)
    ks = k.repeat_interleave(hq // hk, dim=1).transpose(0, 1).unsqueeze(0)
    vs = v.repeat_interleave(hq // hk, dim=1).transpose(0, 1).unsqueeze(0)

    def sdpa_run() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    want = sdpa_run()[0].transpose(0, 1).float()
    t_sdpa = do_bench(sdpa_run, warmup=25, rep=200, return_mode="median")
    flops = 2 * 2 * hq * tokens * tokens * d / 2  # causal: half the score matrix
    print(f"prefill attention, 2048 tokens, bf16; SDPA flash {t_sdpa * 1e3:.1f} us "
          f"({flops / t_sdpa / 1e9:.1f} TFLOP/s); target triton / SDPA <= 1.5")
    for tile in [None, *TILES]:
        if tile is not None:
            os.environ["FLASHLLM_PREFILL_TILE"] = ",".join(map(str, tile))
        try:
            got = triton_run().float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, f"relative error {err}"
            t = do_bench(triton_run, warmup=25, rep=200, return_mode="median")
            print(f"  triton {tile or 'default'}: {t * 1e3:8.1f} us  {flops / t / 1e9:7.1f} TFLOP/s  "
                  f"ratio {t / t_sdpa:.2f}  err {err:.1e}", flush=True)
        except Exception as exc:  # a tile that fails to compile or check is reported
            print(f"  triton {tile}: FAIL {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        os.environ.pop("FLASHLLM_PREFILL_TILE", None)


if __name__ == "__main__":
    main()
