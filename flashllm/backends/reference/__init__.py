"""The reference backend: every op's plain-PyTorch body, registered for any device ("*")."""

from __future__ import annotations

import torch

from flashllm.ops import op_specs
from flashllm.registry.backend import ANY_DEVICE, Backend, Caps

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

# Quantization schemes each reference op implements; widened as quant/ adds schemes.
REFERENCE_QUANT: dict[str, frozenset[str]] = {
    "quant_matmul": frozenset({"none", "w8a16", "w4a16"}),
    "fused_moe": frozenset({"none"}),
}


def make_backend() -> Backend:
    """Build the reference backend with one kernel per op: the op spec's own body."""
    backend = Backend(
        name="reference",
        device_type=ANY_DEVICE,
        priority=0,
        description="portable PyTorch reference; the ground truth every kernel is tested against",
    )
    for name, spec in op_specs().items():
        caps = Caps(
            dtypes=FLOAT_DTYPES,
            kv_dtypes=FLOAT_DTYPES,
            quant=REFERENCE_QUANT.get(name, frozenset({"none"})),
        )
        backend.kernel(name, caps)(spec.reference)
    return backend
