"""The reference backend: every op's plain-PyTorch body, registered for any device ("*")."""

from __future__ import annotations

import torch

from flashllm.ops import op_specs
from flashllm.ops.fused_moe import EXPERT_SCHEMES, MOE_ACTIVATIONS
from flashllm.ops.quant_matmul import AFFINE_CAPABILITY
from flashllm.ops.quant_matmul import SCHEMES as QUANT_MATMUL_SCHEMES
from flashllm.registry.backend import ANY_DEVICE, Backend, Caps
from flashllm.registry.resolve import OpTable

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
# write_kv_cache and paged_attention quantize / dequantize int8 and fp8 (e4m3) KV caches
KV_DTYPES = FLOAT_DTYPES | {torch.int8, torch.float8_e4m3fn}

# Quantization schemes each reference op implements; widened as quant/ adds schemes.
REFERENCE_QUANT: dict[str, frozenset[str]] = {
    "quant_matmul": QUANT_MATMUL_SCHEMES | {AFFINE_CAPABILITY},  # GGUF layouts: dequantize reads offsets
    "fused_moe": EXPERT_SCHEMES,
}


# Reference bodies that read tensor values on the host (lengths, expert ids, a range check): a
# device graph cannot capture them, so the model runner stays eager when one of them is bound.
HOST_SYNCING_OPS = frozenset({"paged_attention", "fused_moe", "write_kv_cache", "latent_attention"})


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
            kv_dtypes=KV_DTYPES,
            quant=REFERENCE_QUANT.get(name, frozenset({"none"})),
            graph_safe=name not in HOST_SYNCING_OPS,
            alibi=name == "paged_attention",
            softcap=name == "paged_attention",
            sinks=name == "paged_attention",
            moe_activations=MOE_ACTIVATIONS if name == "fused_moe" else frozenset({"silu"}),
        )
        backend.kernel(name, caps)(spec.reference)
    return backend


def reference_op_table() -> OpTable:
    """An op table bound to the reference kernels of every op, for tests and tools.

    It lives with the backend it binds, not in registry/: the registry finds backends through
    plugins and imports none of them.
    """
    backend = make_backend()
    return OpTable({op: kernels[0] for op, kernels in backend.kernels.items()}, [])
