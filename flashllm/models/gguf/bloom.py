"""BLOOM GGUF files (`bloom`: BLOOM 560m..176B, BLOOMZ): run as flashllm's BloomForCausalLM.

What llama.cpp does with them (src/models/bloom.cpp, the converter's BloomModel): the embedding followed by a LayerNorm
with a bias (`token_embd_norm`); pre-norm layers of biased LayerNorms (`attn_norm`, `ffn_norm`, eps
`bloom.attention.layer_norm_epsilon`, which the loader requires); one `attn_qkv` weight and bias whose rows the
converter regrouped from the checkpoint's head-by-head [q | k | v] triples into all query rows, then all key rows, then
all value rows, which the graph views back as q, k and v; ALiBi with a maximum bias of 8 hard-coded in the loader
(whatever the file says), which gives BLOOM's own slopes; `attn_output` with a bias; the ungated MLP
ffn_down(gelu(ffn_up(x))) with biases and ggml's tanh-approximated GELU (BLOOM's own); a final biased LayerNorm and an
`output` head, which the converter writes as a copy of the embedding where the checkpoint ties it (the file then loads
untied, with the same values), else the embedding itself. Every one of those tensors is required, biases included; a
file without them, with separate attn_q / attn_k / attn_v, with key / value heads fewer than the query heads, or with
an MLP other than 4 x hidden (BloomConfig has no other) is not one flashllm runs as BLOOM, and is refused.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps
from flashllm.models.gguf.reader import GGUFFile

ARCH = "bloom"
# the embedding's LayerNorm, which Llama's names do not hold (ArchMap.tensor_names)
TENSOR_NAMES = {"token_embd_norm.weight": "model.embed_tokens.norm.weight",
                "token_embd_norm.bias": "model.embed_tokens.norm.bias"}
# the tensors llama.cpp's bloom loader requires (checked in the first layer) / that its graph never reads
_REQUIRED = ("token_embd_norm.weight", "token_embd_norm.bias", "output_norm.bias", "blk.0.attn_norm.bias",
             "blk.0.attn_qkv.weight", "blk.0.attn_qkv.bias", "blk.0.attn_output.bias", "blk.0.ffn_norm.weight",
             "blk.0.ffn_norm.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias")
_UNREAD = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.attn_q_norm.weight", "blk.0.attn_norm_2.weight")


def bloom_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The BloomForCausalLM config.json fields of a `bloom` file (module docstring), under BloomConfig's names."""
    eps = layer_norm_eps(gf, ARCH)
    check_tensors(gf, ARCH, _REQUIRED, _UNREAD)
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    if raw["num_key_value_heads"] != heads:
        raise ModelLoadError(f"{gf.name}: {raw['num_key_value_heads']} key / value heads for {heads} query heads; "
                             "BLOOM has no grouped-query attention")
    if raw["intermediate_size"] != 4 * hidden:
        raise ModelLoadError(f"{gf.name}: feed_forward_length {raw['intermediate_size']} is not 4 x embedding_length "
                             f"({4 * hidden}); BLOOM's MLP is 4 x hidden wide")
    return {"layer_norm_epsilon": eps, "n_layer": raw["num_hidden_layers"], "n_head": heads}
