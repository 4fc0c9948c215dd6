"""ALiBi as a kernel capability: a paged_attention kernel that does not claim it is never bound for an
ALiBi model (the reference runs instead, recorded as a fallback), and the slopes follow the ALiBi paper."""

from __future__ import annotations

import math

import pytest
import torch

from flashllm.backends import npu
from flashllm.ops import op_specs
from flashllm.ops.alibi_slopes import alibi_slopes
from flashllm.registry.backend import Backend, Caps, OpRequest
from flashllm.registry.resolve import DeviceSelection, KernelResolutionError, resolve_ops
from flashllm.testing.backends import cpu_selection

FP32 = frozenset({torch.float32})


def _selection_without_alibi() -> tuple[DeviceSelection, object]:
    """A cpu backend whose only kernel is a paged_attention that does not claim ALiBi."""
    backend = Backend(name="no-alibi", device_type="cpu", priority=1)
    backend.kernel("paged_attention", Caps(dtypes=FP32, kv_dtypes=FP32))(op_specs()["paged_attention"].reference)
    return cpu_selection(backend, FP32)


def test_an_alibi_request_falls_back_to_the_reference_visibly() -> None:
    selection, plugins = _selection_without_alibi()
    plain = resolve_ops(selection, OpRequest(torch.float32, torch.float32, "none", 64, 16), plugins=plugins)
    assert plain.sources["paged_attention"] == "no-alibi"
    table = resolve_ops(selection, OpRequest(torch.float32, torch.float32, "none", 64, 16, alibi=True),
                        plugins=plugins)
    assert table.sources["paged_attention"] == "reference" and table.kernel("paged_attention").caps.alibi
    (fallback,) = [f for f in table.fallbacks if f.op == "paged_attention"]
    assert "ALiBi" in fallback.reason and "paged_attention" in table.format_fallbacks()


def test_strict_kernels_refuse_an_alibi_model_on_a_kernel_without_it() -> None:
    selection, plugins = _selection_without_alibi()
    with pytest.raises(KernelResolutionError, match="ALiBi"):
        resolve_ops(selection, OpRequest(torch.float32, torch.float32, "none", 64, 16, alibi=True),
                    plugins=plugins, strict=True)


def test_only_paged_attention_is_gated_on_alibi() -> None:
    uses = {name: spec.uses for name, spec in op_specs().items()}
    assert [name for name, fields in uses.items() if "alibi" in fields] == ["paged_attention"]


def test_the_npu_attention_kernel_does_not_claim_alibi() -> None:
    """It raises on alibi_slopes (tests/unit/test_vendor_adapters.py), so it must not be bound for ALiBi."""
    (kernel,) = npu.make_backend().kernels["paged_attention"]
    request = OpRequest(torch.float16, torch.float16, "none", 128, 128, alibi=True)
    assert "ALiBi" in kernel.mismatch(request, op_specs()["paged_attention"].uses)
    assert kernel.mismatch(OpRequest(torch.float16, torch.float16, "none", 128, 128),
                           op_specs()["paged_attention"].uses) is None


def _paper_slopes(n: int) -> list[float]:
    """The ALiBi paper's recipe: start = 2^(-2^-(log2(n) - 3)), slopes start^1..start^n for a power of
    two; otherwise the closest power of two's slopes, then every other slope of twice as many heads."""
    if math.log2(n).is_integer():
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return _paper_slopes(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 6, 8, 12, 32, 40, 64, 80])
def test_slopes_follow_the_paper(heads: int) -> None:
    expected = torch.tensor(_paper_slopes(heads), dtype=torch.float32)
    torch.testing.assert_close(alibi_slopes(heads), expected, rtol=1e-6, atol=0)


def test_slopes_of_eight_and_forty_heads() -> None:
    assert alibi_slopes(8).tolist() == [2.0 ** -(h + 1) for h in range(8)]
    # Baichuan-13B's 40 heads: 32 slopes 2^(-(h+1)/4), then 2^-(1/8), 2^-(3/8), ..., 2^-(15/8)
    forty = [2 ** (-(h + 1) / 4) for h in range(32)] + [2 ** (-(2 * j + 1) / 8) for j in range(8)]
    torch.testing.assert_close(alibi_slopes(40), torch.tensor(forty), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="num_heads=0"):
        alibi_slopes(0)
