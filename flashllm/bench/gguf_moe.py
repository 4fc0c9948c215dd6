"""GGUF export of mixture-of-experts checkpoints (Qwen2-MoE, Qwen3-MoE, Mixtral) for the llama.cpp baseline: experts stacked.

llama.cpp keeps a layer's experts as one tensor per projection, ffn_{gate,up,down}_exps of GGUF shape
(K, N, E) (numpy (E, N, K)), where HF checkpoints hold one tensor per expert and projection. This module
groups those per-expert tensors into stacked ones under a name gguf_export maps to the GGUF one
(`model.layers.L.mlp.experts.gate_proj.weight` -> `blk.L.ffn_gate_exps.weight`), reshapes the shared
expert's (1, hidden) gate to the (hidden,) llama.cpp reads, and writes the routing hyperparameters.
It refuses routing llama.cpp would run differently: its qwen2moe graph never renormalizes the top-k
weights and has no dense layers, its qwen3moe graph always renormalizes, has no dense layers and adds no
q / k / v bias, its llama (Mixtral) graph always renormalizes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = frozenset({"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"})
# llama.cpp's converter writes the routers in F32 whatever the file type, and llama-quantize leaves them so
FLOAT_NAME_PARTS = (".ffn_gate_inp.",)
# HF module names (after the layer index) of the non-expert MoE tensors -> GGUF's
LAYER_NAMES = {
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_EXPERT = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_SHARED_GATE = re.compile(r"^model\.layers\.\d+\.mlp\.shared_expert_gate\.weight$")

Loader = Callable[[], np.ndarray]


class MoEExportError(ValueError):
    """The MoE checkpoint cannot be written as a GGUF llama.cpp runs the same way; the message says why."""


def check(config: Any) -> None:
    """Refuse routing llama.cpp's graph for the architecture would not reproduce (see the module docstring)."""
    if config.architecture == "MixtralForCausalLM":
        return  # always renormalized, every layer sparse, no shared expert: what llama.cpp's llama graph runs
    if config.architecture == "Qwen3MoeForCausalLM":
        _check_qwen3_moe(config)
        return
    if config.norm_topk_prob:
        raise MoEExportError("Qwen2-MoE with norm_topk_prob=true has no GGUF export here: llama.cpp's qwen2moe graph "
                             "never renormalizes the top-k routing weights")
    if not all(config.sparse_layers):
        raise MoEExportError("Qwen2-MoE with dense MLP layers (decoder_sparse_step > 1 or mlp_only_layers) has no GGUF "
                             "export here: llama.cpp's qwen2moe graph makes every layer sparse")
    if not config.shared_expert_intermediate_size:
        raise MoEExportError("Qwen2-MoE without a shared expert has no GGUF export here: llama.cpp's qwen2moe graph "
                             "reads the shared expert's tensors")


def _check_qwen3_moe(config: Any) -> None:
    if not config.norm_topk_prob:
        raise MoEExportError("Qwen3-MoE with norm_topk_prob=false has no GGUF export here: llama.cpp's qwen3moe graph "
                             "always renormalizes the top-k routing weights")
    if not all(config.sparse_layers):
        raise MoEExportError("Qwen3-MoE with dense MLP layers (decoder_sparse_step > 1 or mlp_only_layers) has no GGUF "
                             "export here: llama.cpp's qwen3moe graph makes every layer sparse")
    if config.qkv_bias:
        raise MoEExportError("Qwen3-MoE with attention_bias=true has no GGUF export here: llama.cpp's qwen3moe graph "
                             "adds no q / k / v bias")


def group_experts(entries: list[tuple[str, tuple[int, ...], Loader]],
                  num_experts: int) -> Iterator[tuple[str, tuple[int, ...], Loader]]:
    """(HF name, shape, loader) entries -> the same with each layer's per-expert tensors of one projection
    replaced by one stacked (E, N, K) entry named `model.layers.L.mlp.experts.<proj>.weight`, and the
    shared expert's gate as (hidden,). Raises MoEExportError where an expert is missing or mis-shaped."""
    groups: dict[tuple[int, str], dict[int, tuple[tuple[int, ...], Loader]]] = {}
    for name, shape, load in entries:
        match = _EXPERT.match(name)
        if match is None:
            if _SHARED_GATE.match(name):
                yield name, (int(np.prod(shape)),), _flattened(load)
            else:
                yield name, shape, load
            continue
        proj = _PROJ.get(match["proj"], match["proj"])
        groups.setdefault((int(match["layer"]), proj), {})[int(match["expert"])] = (shape, load)
    for (layer, proj), experts in sorted(groups.items()):
        shapes = {shape for shape, _ in experts.values()}
        if sorted(experts) != list(range(num_experts)) or len(shapes) != 1:
            raise MoEExportError(f"layer {layer} {proj}: experts {sorted(experts)[:8]}... of shapes {sorted(shapes)}; "
                                 f"expected experts 0..{num_experts - 1} of one shape")
        loaders = [experts[e][1] for e in range(num_experts)]
        yield (f"model.layers.{layer}.mlp.experts.{proj}.weight", (num_experts, *shapes.pop()),
               _stacked(loaders))


def stack_experts(entries: list[tuple[str, tuple[int, ...], Loader]], config: Any) -> Iterator[tuple[str, tuple[int, ...],
                                                                                             Loader]]:
    """gguf_export's ArchSpec.transform for Qwen2-MoE, Qwen3-MoE and Mixtral: group_experts over the config's experts."""
    return group_experts(entries, config.num_experts)


def _flattened(load: Loader) -> Loader:
    return lambda: load().reshape(-1)


def _stacked(loaders: list[Loader]) -> Loader:
    return lambda: np.stack([load() for load in loaders])


def add_hparams(writer: Any, config: Any) -> None:
    """The expert counts and sizes llama.cpp's loader reads."""
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.architecture != "MixtralForCausalLM":  # Mixtral's experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def streamed_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors one batch-1 decode step reads, as flashllm's WeightBytes.streamed counts
    its own: all tensors, less the token embedding table where an `output.weight` head is stored apart
    (a step reads one row of the table), and of each layer's stacked experts (`*_exps`) only the
    `expert_used_count` of `expert_count` a token is routed to. Dense files: the embedding rule only."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    arch = bytes(reader.get_field("general.architecture").parts[-1]).decode()
    counts = [reader.get_field(f"{arch}.{key}") for key in ("expert_count", "expert_used_count")]
    experts, used = (int(field.parts[-1][0]) if field is not None else 0 for field in counts)
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        share = used / experts if experts and t.name.endswith("_exps.weight") else 1.0
        total += int(t.n_bytes) * share
    return round(total)
