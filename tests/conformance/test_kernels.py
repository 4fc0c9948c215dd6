"""Generated from the registry: every kernel x every dtype it claims x every input case vs the reference."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from flashllm.ops import op_specs
from flashllm.ops.testing import case_kv_dtype, case_quant, cases, make_inputs, run_case, unclaimed_case
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import Backend, Kernel
from flashllm.registry.plugins import make_plugin_manager

DEFAULT_HEAD_SIZE, DEFAULT_BLOCK_SIZE = 64, 16


class Case(NamedTuple):
    backend: Backend
    kernel: Kernel
    dtype: torch.dtype
    case: str


def _generate() -> list:
    params = []
    specs = op_specs()
    for backend in make_plugin_manager().backends().values():
        if backend.name == "reference":
            continue  # the reference is checked against naive computations in tests/unit
        for op, kernels in backend.kernels.items():
            for kernel in kernels:
                if kernel.fn is specs[op].reference:
                    continue  # a backend running the portable body as is: identical by construction
                for dtype in sorted(kernel.caps.dtypes, key=str):
                    for case in cases(op):
                        if case_quant(op, case) not in kernel.caps.quant:
                            continue  # the kernel does not claim this weight format; resolve never picks it
                        if unclaimed_case(kernel, op, case):
                            continue  # the kernel does not claim ALiBi / a score cap; resolve never picks it for those
                        kv_dtype = case_kv_dtype(op, case)
                        if kv_dtype is not None and kv_dtype not in kernel.caps.kv_dtypes:
                            continue  # the kernel does not claim this quantized KV cache; resolve never picks it
                        name = f"{backend.name}-{op}-{str(dtype).removeprefix('torch.')}-{case}"
                        params.append(pytest.param(Case(backend, kernel, dtype, case), id=name))
    return params


@pytest.mark.parametrize("c", _generate())
def test_kernel_matches_reference(c: Case) -> None:
    ok, reason = c.backend.is_available()
    if not ok:
        pytest.skip(f"backend {c.backend.name!r} unavailable: {reason}")
    device = torch.device(c.backend.device_type)
    profile = c.backend.device_profile(device)
    if c.dtype not in profile.dtypes:
        pytest.skip(f"{profile.name} cannot run {c.dtype}")
    kv_dtype = case_kv_dtype(c.kernel.op, c.case)
    if kv_dtype is not None and kv_dtype not in profile.kv_dtypes:
        pytest.skip(f"{profile.name} has no {kv_dtype} KV cache")
    head_size = min(c.kernel.caps.head_sizes) if c.kernel.caps.head_sizes else DEFAULT_HEAD_SIZE
    block_size = min(c.kernel.caps.block_sizes) if c.kernel.caps.block_sizes else DEFAULT_BLOCK_SIZE
    inputs = make_inputs(c.kernel.op, c.dtype, device, head_size=head_size, block_size=block_size, case=c.case)
    # a kernel that rounds its inputs on purpose (the cpu int4 x int8 product) says how; it is held
    # to the reference evaluated on the inputs so rounded, cast to the activation dtype
    rounding = getattr(c.kernel.fn, "rounded_inputs", None)
    expected = run_case(op_specs()[c.kernel.op].reference, c.kernel.op,
                        inputs if rounding is None else rounding(inputs))
    if rounding is not None and isinstance(expected, torch.Tensor):
        expected = expected.to(c.dtype)
    actual = run_case(c.kernel.fn, c.kernel.op, inputs)
    if kv_dtype is not None and c.kernel.op == "write_kv_cache":
        # quantized writes: codes exactly (one code off is a whole scale step); dynamic scales
        # (max|x| / qmax in fp32) within 2 ulps, as a kernel may multiply by 1 / qmax instead
        codes, scales = actual[:2], actual[2:]
        torch.testing.assert_close(codes, expected[:2], atol=0, rtol=0)
        torch.testing.assert_close(scales, expected[2:], atol=0, rtol=2.4e-7)
        return
    # paged_attention on a quantized cache: every kernel dequantizes the same codes and scales to
    # the same fp32 values, so it keeps the activation dtype's tolerance
    assert_close(actual, expected, c.dtype)


@pytest.mark.parametrize("backend", list(make_plugin_manager().backends().values()), ids=lambda b: b.name)
def test_backend_is_available_here(backend: Backend) -> None:
    """One visible line per backend in `nox -s conformance(backend=...)`: runs, or why it cannot."""
    ok, reason = backend.is_available()
    if not ok:
        pytest.skip(f"backend {backend.name!r} unavailable: {reason}")
    if not any(k.fn is not op_specs()[op].reference for op, ks in backend.kernels.items() for k in ks):
        pytest.skip(f"backend {backend.name!r} has no kernels of its own to check against the reference")
    assert backend.device_count() >= 1


def test_every_op_has_input_cases() -> None:
    for op in op_specs():
        assert len(list(cases(op))) >= 2, op
