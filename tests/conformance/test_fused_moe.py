"""fused_moe kernels beyond the generated cases: unchosen experts are never read, empty batches, bad expert ids,
a shared expert as extra experts every token routes to."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu import moe as cpu_moe
from flashllm.backends.xla import kernels as xla_kernels
from flashllm.ops.fused_moe import fused_moe as reference
from flashllm.ops.testing import make_inputs
from flashllm.ops.testing_moe import add_shared_expert
from flashllm.ops.tolerances import assert_close

KERNELS = {"reference": reference, "cpu": cpu_moe.fused_moe}
# top-1, top-2 and top-8, renormalized and not, float and int8 experts
SHARED_CASES = ("top1_decode_batch", "spread", "top8_renormalized", "top2_one_token_unnormalized", "w8a16_top2",
                "w8a16_one_token_unnormalized")


@pytest.mark.parametrize("case", SHARED_CASES)
@pytest.mark.parametrize("name", [*KERNELS, "xla"])
def test_a_shared_expert_runs_as_experts_every_token_routes_to(name, case) -> None:
    """Qwen2-MoE's shared expert (four times a routed expert's width, like Qwen1.5-MoE's 5632 over 1408)
    and its sigmoid gate, passed as four more experts in every token's slots, against the dense float64
    sum written independently (flashllm/ops/testing_moe.py)."""
    kernel = xla_kernels.fused_moe if name == "xla" else KERNELS[name]
    routed = make_inputs("fused_moe", torch.float32, case=case)
    inputs, expected = add_shared_expert(routed, parts=4, seed=3)
    actual = kernel(**inputs)
    assert_close(actual, expected.float(), torch.float32)
    assert (kernel(**routed).double() - expected).abs().max() > 1e-2  # the shared expert moves the output


@pytest.mark.parametrize("case", ["one_token", "top4_60_experts_unnormalized", "top8_one_token_unnormalized"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_experts_no_token_is_routed_to_are_never_read(name, case) -> None:
    """NaN weights in every unchosen expert leave the output finite and unchanged: a kernel that ran
    every expert and masked the result afterwards would carry the NaNs through."""
    inputs = make_inputs("fused_moe", torch.float32, case=case)
    expected = KERNELS[name](**inputs)
    unchosen = torch.ones(inputs["w13"].shape[0], dtype=torch.bool)
    unchosen[inputs["topk_ids"].unique()] = False
    assert unchosen.any()
    inputs["w13"][unchosen] = float("nan")
    inputs["w2"][unchosen] = float("nan")
    actual = KERNELS[name](**inputs)
    assert torch.isfinite(actual).all()
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("name", list(KERNELS))
def test_an_empty_batch_gives_an_empty_output(name) -> None:
    inputs = make_inputs("fused_moe", torch.bfloat16, case="spread")
    inputs["x"], inputs["topk_weights"] = inputs["x"][:0], inputs["topk_weights"][:0]
    inputs["topk_ids"] = inputs["topk_ids"][:0]
    out = KERNELS[name](**inputs)
    assert out.shape == (0, inputs["x"].shape[1]) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bad_id", [-1, 6])
def test_the_cpu_kernel_refuses_expert_ids_outside_the_layer(bad_id) -> None:
    inputs = make_inputs("fused_moe", torch.float32, case="spread")  # 6 experts
    inputs["topk_ids"][2, 1] = bad_id
    with pytest.raises(ValueError, match=r"topk_ids range .* is outside \[0, 6\) for 6 experts"):
        cpu_moe.fused_moe(**inputs)


def test_the_cpu_backend_binds_its_own_fused_moe_kernel() -> None:
    from flashllm.backends import cpu

    kernels = cpu.make_backend().kernels["fused_moe"]
    assert [k.fn for k in kernels] == [cpu_moe.fused_moe]
