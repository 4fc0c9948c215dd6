"""Every kernel of the template x every dtype its caps claim x every input case, against the reference."""

from __future__ import annotations

import pytest
import torch
from flashllm.ops import op_specs
from flashllm.ops.testing import case_kv_dtype, case_quant, cases, make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import Backend

from flashllm_backend_template.backend import make_backend

SEEDS = (0, 1, 2)


def _claims() -> list:
    """(op, dtype, case) for each claimed cell, generated from the caps so a new claim is tested too."""
    params = []
    for op, kernels in make_backend().kernels.items():
        for index, kernel in enumerate(kernels):
            for dtype in sorted(kernel.caps.dtypes, key=str):
                for case in cases(op):
                    if case_quant(op, case) not in kernel.caps.quant:
                        continue  # a weight format the kernel does not claim: resolution never picks it
                    kv_dtype = case_kv_dtype(op, case)
                    if kv_dtype is not None and kv_dtype not in kernel.caps.kv_dtypes:
                        continue
                    name = f"{op}[{index}]-{str(dtype).removeprefix('torch.')}-{case}"
                    params.append(pytest.param(op, index, dtype, case, id=name))
    return params


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("op", "index", "dtype", "case"), _claims())
def test_kernel_matches_reference(template_backend: Backend, op: str, index: int, dtype: torch.dtype,
                                  case: str, seed: int) -> None:
    ok, reason = template_backend.is_available()
    assert ok, f"the template backend should run on this host: {reason}"
    kernel = template_backend.kernels[op][index]
    device = torch.device(template_backend.device_type)
    assert dtype in template_backend.device_profile(device).dtypes, "a kernel claims a dtype its device lacks"
    inputs = make_inputs(op, dtype, device, seed=seed, case=case)
    expected = run_case(op_specs()[op].reference, op, inputs)
    actual = run_case(kernel.fn, op, inputs)
    assert_close(actual, expected, dtype)


def test_the_installed_backend_registers_what_the_package_builds(template_backend: Backend) -> None:
    """What the entry point registered is what the parametrization above was generated from."""
    built = make_backend()
    assert template_backend.proof == "conformance"
    assert {op: [k.caps for k in ks] for op, ks in template_backend.kernels.items()} == \
        {op: [k.caps for k in ks] for op, ks in built.kernels.items()}


def test_a_wrong_kernel_fails_the_comparison() -> None:
    """The comparison is strict enough to catch a common mistake: eps outside the square root."""
    inputs = make_inputs("rms_norm", torch.float32, case="plain")

    def eps_outside(x, weight, eps, residual=None):
        x32 = x.float()
        return (x32 / (x32.square().mean(-1, keepdim=True).sqrt() + eps) * weight.float()).to(x.dtype)

    inputs["eps"] = 1e-2
    with pytest.raises(AssertionError):
        assert_close(run_case(eps_outside, "rms_norm", inputs),
                     run_case(op_specs()["rms_norm"].reference, "rms_norm", inputs), torch.float32)
