"""Per-dtype tolerances that every kernel must meet against the op reference."""

from __future__ import annotations

import torch

# (atol, rtol) between a kernel and the reference run at the same activation dtype.
# Both outputs are rounded to `dtype`, and a kernel may legitimately round intermediates (a GEMM
# output, the normalized row) at different points or sum in another order, so allow about two
# units in the last place of the dtype's mantissa, plus an atol for values that cancel near zero:
#   float32:  fp32 accumulation in another order drifts ~1e-6 relative over a few hundred terms.
#   float16:  10-bit mantissa, ulp(1) = 2**-10 ~ 9.8e-4, so rtol 2e-3 is ~2 ulps.
#   bfloat16: 7-bit mantissa, ulp(1) = 2**-7 ~ 7.8e-3, so rtol 1.6e-2 is ~2 ulps.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing outputs in `dtype`; KeyError naming the known dtypes otherwise."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in TOLERANCES)
        raise KeyError(
            f"no tolerance defined for {dtype}; known dtypes: {known} "
            "(add one to flashllm/ops/tolerances.py with a reason)"
        ) from None


def assert_close(actual: object, expected: object, dtype: torch.dtype) -> None:
    """torch.testing.assert_close with the tolerances of `dtype`; accepts tensors or tuples of them."""
    atol, rtol = tolerance(dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
