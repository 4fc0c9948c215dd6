"""GGUF export of IBM Granite 3.x dense checkpoints (GraniteForCausalLM) as llama.cpp's converter writes them: Llama's
tensors (Q/K rows reordered for llama.cpp's interleaved rotary) and the four multipliers under llama.cpp's names.

llama.cpp reads each scale only when it is non-zero and defaults the attention scale to head_dim ** -0.5, where
transformers' default multiplier is 1.0; every flashllm Granite config has all four (positive), so all four are
written, and the loader (flashllm.models.gguf.granite) reads them back as the graph applies them.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "GraniteForCausalLM"


def add_hparams(writer: Any, config: Any) -> None:
    """`granite.embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` (which llama.cpp requires)."""
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_logit_scale(config.logits_scaling)
