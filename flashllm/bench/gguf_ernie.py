"""GGUF export of transformers' Ernie4_5ForCausalLM / Ernie4_5_MoeForCausalLM checkpoints as llama.cpp's converter
writes `ernie4_5` / `ernie4_5-moe` files: the checkpoint's tensors under Llama's names, Q/K rows as they are (the
graph turns adjacent pairs, as ERNIE does), the experts stacked, the router's choice bias (moe_statics) as
`exp_probs_b`, the MoE layout as leading_dense_block_count and interleave_moe_layer_step. It refuses what llama.cpp's
graphs would run differently (flashllm.models.gguf.ernie says how they run): use_bias (the graphs add no output or
MLP biases), MoE layers ending before the last one (the graph has no end index)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from flashllm.bench import gguf_deepseek, gguf_moe

ARCHITECTURE, MOE_ARCHITECTURE = "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"
# HF module (after "model.layers.L.") -> GGUF layer part, over Llama's and gguf_moe's
MOE_LAYER_NAMES = {module: part for module, part in gguf_deepseek.LAYER_NAMES.items() if module.startswith("mlp.")}
_STATICS = re.compile(r"^(model\.layers\.\d+\.mlp)\.(?:gate\.)?moe_statics\.e_score_correction_bias$")


def check(config: Any) -> None:
    """ValueError for what llama.cpp's ernie4_5 / ernie4_5-moe graphs would run differently (module docstring)."""
    if config.attention_bias or config.mlp_bias:
        raise ValueError("ERNIE 4.5 with use_bias=true has no GGUF export here: llama.cpp's graph adds no output or "
                         "MLP biases")
    sparse = getattr(config, "sparse_layers", ())
    if sparse and not sparse[-1] and any(sparse) and config.raw.get("moe_layer_end_index", -1) not in (
            -1, config.num_hidden_layers - 1):
        raise ValueError(f"ERNIE 4.5 MoE layers ending at moe_layer_end_index={config.raw['moe_layer_end_index']} "
                         "have no GGUF export here: llama.cpp's graph makes them run to the last layer")


def transform(entries: list[gguf_deepseek.Entry], config: Any) -> Iterator[gguf_deepseek.Entry]:
    """The checkpoint's entries as the converter writes them: experts stacked, the choice bias under a name
    gguf_export maps to `exp_probs_b.bias`, the MTP tensors left out."""
    for name, shape, load in gguf_moe.group_experts(entries, config.n_routed_experts):
        if name.startswith("model.mtp_"):
            continue
        statics = _STATICS.match(name)
        yield (gguf_deepseek.renamed_bias(f"{statics[1]}.gate.e_score_correction_bias") if statics else name,
               shape, load)


def add_hparams(writer: Any, config: Any) -> None:
    """ernie4_5-moe's MoE keys (gguf_export writes the generic ones)."""
    sparse = [i for i, is_moe in enumerate(config.sparse_layers) if is_moe]
    step = sparse[1] - sparse[0] if len(sparse) > 1 else sparse[0] + 1 if sparse else 1
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_interleave_moe_layer_step(step)
    writer.add_leading_dense_block_count(config.raw.get("moe_layer_start_index", 1))
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
