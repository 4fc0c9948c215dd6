"""GGUF export of IBM Granite 3.x checkpoints (GraniteForCausalLM, GraniteMoeForCausalLM) as llama.cpp's converter
writes them: Llama's tensors (Q/K rows reordered for llama.cpp's interleaved rotary) and the four multipliers under
llama.cpp's names; Granite-MoE's stacked experts split into gate / up / down stacks (`granitemoe` files).

llama.cpp reads each scale only when it is non-zero and defaults the attention scale to head_dim ** -0.5, where
transformers' default multiplier is 1.0; every flashllm Granite config has all four (positive), so all four are
written, and the loader (flashllm.models.gguf.granite) reads them back as the graph applies them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

ARCHITECTURE, MOE_ARCHITECTURE = "GraniteForCausalLM", "GraniteMoeForCausalLM"
_MOE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(input_linear|output_linear|router\.layer)\.weight$")
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def add_hparams(writer: Any, config: Any) -> None:
    """`granite.embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` (which llama.cpp requires)."""
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_logit_scale(config.logits_scaling)


def add_moe_hparams(writer: Any, config: Any) -> None:
    """Granite's scales and the expert counts llama.cpp's granitemoe loader reads (experts feed_forward_length wide)."""
    add_hparams(writer, config)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)


def split_experts(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's entries as the converter writes a Granite-MoE: input_linear (E, 2I, H) as the gate and up
    stacks (its first and second I rows), output_linear as the down stack, router.layer as the router."""
    for name, shape, load in entries:
        moe = _MOE.match(name)
        if moe is None:
            yield name, shape, load
        elif moe[2] == "input_linear":
            half = shape[1] // 2
            for proj, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
                yield f"{moe[1]}.mlp.experts.{proj}.weight", (shape[0], half, shape[2]), _rows(load, rows)
        else:
            target = "mlp.experts.down_proj.weight" if moe[2] == "output_linear" else "mlp.gate.weight"
            yield f"{moe[1]}.{target}", shape, load


def _rows(load: Callable[[], np.ndarray], rows: slice) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(load()[:, rows])
