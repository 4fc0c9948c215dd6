"""fused_moe kernels beyond the generated cases: unchosen experts are never read, empty batches, bad expert ids."""

from __future__ import annotations

import pytest
import torch

from flashllm.backends.cpu import moe as cpu_moe
from flashllm.ops.fused_moe import fused_moe as reference
from flashllm.ops.testing import make_inputs
from flashllm.ops.tolerances import assert_close

KERNELS = {"reference": reference, "cpu": cpu_moe.fused_moe}


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
