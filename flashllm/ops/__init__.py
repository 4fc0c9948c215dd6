"""Abstract ops: each module holds one op whose body is the portable PyTorch reference."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

# Request fields an op's kernels can be gated on beyond the activation dtype (always checked).
REQUEST_FIELDS = frozenset({"kv_dtype", "quant", "head_size", "block_size", "alibi", "softcap", "sinks",
                            "moe_activation"})

OP_NAMES: tuple[str, ...] = (
    "rms_norm",
    "layer_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "write_kv_cache",
    "paged_attention",
    "quant_matmul",
    "fused_moe",
    "lora_shrink",
    "lora_expand",
    "latent_attention",
)


@dataclass(frozen=True, slots=True)
class OpSpec:
    """An op: its name, its reference function (the spec), and the request fields it is gated on.

    `uses` names the fields of an op request (see REQUEST_FIELDS) that a kernel's caps are
    matched against for this op, e.g. `paged_attention` cares about the KV dtype and block size,
    `rms_norm` only about the activation dtype.
    """

    name: str
    reference: Callable[..., object]
    uses: frozenset[str]

    @property
    def signature(self) -> inspect.Signature:
        """The reference signature every kernel of this op must match."""
        return inspect.signature(self.reference)


def _load_spec(name: str) -> OpSpec:
    module = importlib.import_module(f"{__name__}.{name}")
    uses = frozenset(getattr(module, "USES", frozenset()))
    unknown = uses - REQUEST_FIELDS
    if unknown:
        raise ValueError(f"op {name!r} declares unknown request fields {sorted(unknown)}")
    return OpSpec(name=name, reference=getattr(module, name), uses=uses)


def op_specs() -> dict[str, OpSpec]:
    """Every op spec, keyed by op name, in declaration order."""
    return {name: _load_spec(name) for name in OP_NAMES}
