"""Mixture-of-experts GGUF files (Mixtral as llama.cpp's "llama" with experts, qwen2moe, qwen3moe): config fields
and expert tensors.

llama.cpp keeps a layer's experts as one tensor per projection, `blk.L.ffn_{gate,up,down}_exps.weight` of ggml
shape (K, N, E) (numpy (E, N, K)); its router is `ffn_gate_inp`, a Qwen2-MoE shared expert `ffn_*_shexp` with
the (hidden,) sigmoid gate `ffn_gate_inp_shexp`. The routing follows what llama.cpp's graph for the arch runs,
not metadata it ignores: softmax over the experts (the three graphs hard-code it, whatever
`<arch>.expert_gating_func` says), top-k renormalized for llama (Mixtral) and qwen3moe but never for qwen2moe,
every layer sparse (the graphs have no dense layers: decoder_sparse_step 1, no mlp_only_layers).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

# More experts than this is not a model flashllm could run (models/mixtral.py's MAX_NUM_EXPERTS).
MAX_EXPERTS = 4096
# GGUF name part (after "blk.L.") of a stacked expert tensor -> the per-expert checkpoint projection
EXPERT_PROJS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# the checkpoint projection -> the MoE layer's part (FusedMoE's shard ids)
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# GGUF name part of the router and shared-expert tensors -> the checkpoint module (after "model.layers.L.")
LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
STACKED_SUFFIX = ".experts.stacked"  # marks the checkpoint name planned for a stacked expert tensor


@dataclass(frozen=True, slots=True)
class MoEGraph:
    """How llama.cpp's graph for one architecture runs its MoE layers (read from its llama-model sources).

    experts_field: the config.json key of the expert count; norm_topk_prob: whether the graph renormalizes
    the top-k routing weights (None: the architecture's config has no such field, Mixtral always does);
    shared_expert: whether the graph adds a sigmoid-gated shared expert; bias_field: the config.json flag
    the architecture reads for attention biases, set to whether the file holds `blk.0.attn_q.bias`.
    """

    experts_field: str
    norm_topk_prob: bool | None
    shared_expert: bool
    bias_field: str


MOE_GRAPHS: dict[str, MoEGraph] = {
    "MixtralForCausalLM": MoEGraph("num_local_experts", None, shared_expert=False, bias_field="attention_bias"),
    "Qwen2MoeForCausalLM": MoEGraph("num_experts", False, shared_expert=True, bias_field="qkv_bias"),
    "Qwen3MoeForCausalLM": MoEGraph("num_experts", True, shared_expert=False, bias_field="attention_bias"),
    # llama.cpp's granite graph with experts: softmax top-k renormalized, experts feed_forward_length wide
    "GraniteMoeForCausalLM": MoEGraph("num_local_experts", None, shared_expert=False, bias_field="attention_bias"),
    # llama.cpp's openai-moe graph: the softmax of the top-k logits (the renormalized top-k of the softmax),
    # experts feed_forward_length wide
    "GptOssForCausalLM": MoEGraph("num_local_experts", None, shared_expert=False, bias_field="attention_bias"),
    # llama.cpp's olmoe graph: softmax top-k never renormalized (olmoe.py sets norm_topk_prob false), experts
    # feed_forward_length wide
    "OlmoeForCausalLM": MoEGraph("num_experts", None, shared_expert=False, bias_field="attention_bias"),
}


def has_experts(gf: GGUFFile, arch: str) -> bool:
    """Whether a file of `arch` declares experts (`<arch>.expert_count` > 0); refuses expert tensors without it."""
    count = gf.get(f"{arch}.expert_count", 0)
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        return True
    if "blk.0.ffn_gate_inp.weight" in gf.tensors:
        raise ModelLoadError(f"{gf.name} holds expert tensors (blk.0.ffn_gate_inp) but {arch}.expert_count is "
                             f"{count!r}; the file is inconsistent, re-convert it")
    return False


def moe_config_fields(gf: GGUFFile, arch: str, architecture: str, hidden: int, layers: int,
                      intermediate: int | None) -> dict[str, Any]:
    """The config.json MoE fields of the file: counts from the metadata, sizes from the expert tensors.

    Every layer's router, expert and shared-expert tensors must have the shapes the counts and hidden
    size give (ModelLoadError naming the first that does not, before anything is allocated); metadata
    sizes (`expert_feed_forward_length`, `expert_shared_feed_forward_length`, Mixtral's
    `feed_forward_length`) must agree with the tensors.
    """
    graph = MOE_GRAPHS[architecture]
    experts = _count(gf, arch, "expert_count", MAX_EXPERTS)
    used = _count(gf, arch, "expert_used_count", MAX_EXPERTS)
    if used > experts:
        raise ModelLoadError(f"{gf.name}: {arch}.expert_used_count={used} exceeds {arch}.expert_count={experts}; "
                             "a token cannot go to more experts than a layer has")
    inter = _size_of(gf, "blk.0.ffn_gate_exps.weight", 1)
    shared = _size_of(gf, "blk.0.ffn_gate_shexp.weight", 1) if graph.shared_expert else 0
    _check_meta(gf, arch, "expert_feed_forward_length", inter)
    fields: dict[str, Any] = {graph.experts_field: experts, "num_experts_per_tok": used,
                              graph.bias_field: "blk.0.attn_q.bias" in gf.tensors}
    if graph.norm_topk_prob is None:  # Mixtral: each expert is intermediate_size wide
        _check_meta(gf, arch, "feed_forward_length", inter)
        fields["intermediate_size"] = inter
    else:
        _check_meta(gf, arch, "expert_shared_feed_forward_length", shared)
        fields.update(moe_intermediate_size=inter, shared_expert_intermediate_size=shared,
                      norm_topk_prob=graph.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                      intermediate_size=intermediate or inter)  # no dense layer reads it
    for layer in range(layers):
        for name, shape in _layer_shapes(layer, hidden, experts, inter, shared).items():
            _check_shape(gf, name, shape, arch)
    return fields


def _count(gf: GGUFFile, arch: str, key: str, maximum: int) -> int:
    value = gf.get(f"{arch}.{key}")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ModelLoadError(f"{gf.name}: {arch}.{key} is {value!r}; expected a whole number in 1..{maximum}")
    return value


def _size_of(gf: GGUFFile, name: str, dim: int) -> int:
    tensor = gf.tensors.get(name)
    if tensor is None or len(tensor.shape) <= dim:
        raise ModelLoadError(f"{gf.name} lacks {name} (or it has too few dimensions); a mixture-of-experts file "
                             "holds each layer's experts stacked, re-convert it with a current llama.cpp")
    return int(tensor.shape[dim])


def _check_meta(gf: GGUFFile, arch: str, key: str, size: int) -> None:
    value = gf.get(f"{arch}.{key}")
    if value is not None and value != size:
        raise ModelLoadError(f"{gf.name}: {arch}.{key}={value!r} differs from the expert tensors' {size} features; "
                             "the file is inconsistent, re-convert it")


def _layer_shapes(layer: int, hidden: int, experts: int, inter: int, shared: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> ggml shape (ne0 = row length first) of one layer's MoE tensors."""
    p = f"blk.{layer}"
    shapes = {f"{p}.ffn_gate_inp.weight": (hidden, experts), f"{p}.ffn_gate_exps.weight": (hidden, inter, experts),
              f"{p}.ffn_up_exps.weight": (hidden, inter, experts), f"{p}.ffn_down_exps.weight": (inter, hidden, experts)}
    if shared:
        shapes.update({f"{p}.ffn_gate_shexp.weight": (hidden, shared), f"{p}.ffn_up_shexp.weight": (hidden, shared),
                       f"{p}.ffn_down_shexp.weight": (shared, hidden), f"{p}.ffn_gate_inp_shexp.weight": (hidden,)})
    return shapes


def _check_shape(gf: GGUFFile, name: str, expected: tuple[int, ...], arch: str) -> None:
    tensor = gf.tensors.get(name)
    if tensor is None:
        raise ModelLoadError(f"{gf.name} lacks {name}; llama.cpp's {arch} graph makes every layer a mixture of "
                             "experts, so the file is incomplete")
    shape = tuple(int(d) for d in tensor.shape)
    if shape != expected:
        raise ModelLoadError(f"{gf.name}: {name} has ggml shape {shape}; the expert count, expert sizes and hidden "
                             f"size give {expected}; the file is inconsistent")


def stacked_name(layer: int, part: str) -> str:
    """The checkpoint name planned for a stacked expert tensor (expanded per expert by expert_tensors)."""
    return f"model.layers.{layer}.mlp{STACKED_SUFFIX}.{EXPERT_PROJS[part]}.weight"


def expert_rows(hf_name: str, data: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A stacked expert tensor's data, (E, N, K) values or (E, N, row bytes) blocks, as one (checkpoint name,
    (N, ...) rows) per expert: `model.layers.L.mlp.experts.<e>.<proj>.weight`, the per-expert names the MoE
    layer's weight_loader takes (and shards under tensor parallelism). Views: nothing is copied here."""
    prefix, _, tail = hf_name.partition(STACKED_SUFFIX)
    for expert in range(data.shape[0]):
        yield f"{prefix}.experts.{expert}{tail}", data[expert]
