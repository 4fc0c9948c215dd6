"""GPT-2 (`gpt2`) and StarCoder 1 / SantaCoder (`starcoder`) GGUF files: run as flashllm's GPT2LMHeadModel and
GPTBigCodeForCausalLM.

What llama.cpp does with them (src/models/gpt2.cpp and starcoder.cpp, one graph; the converter's GPT2Model and
StarCoderModel): the token embedding plus `position_embd` (learned absolute positions, one row per position up to
`context_length`, which its loader requires rows for); pre-norm LayerNorms with a bias (`attn_norm`, `ffn_norm`,
`output_norm`, eps `<arch>.attention.layer_norm_epsilon`); one biased `attn_qkv` whose rows are [q (n_embd) | k | v
(head_count_kv x head size each)] viewed as q, k and v, no rotary; scores scaled by head_size ** -0.5 on every layer;
a biased `attn_output`; the ungated MLP ffn_down(gelu(ffn_up(x))) with biases and ggml's tanh-approximated GELU; an
`output` head where the file has one, else the embedding (tied). The GPT-2 converter transposes the checkpoint's
Conv1D weights (c_attn, c_proj, c_fc) into linear layout, so the file's rows are the projections' outputs; the
StarCoder one writes head_count_kv 1 (multi-query). Every tensor named above but `output` is required, biases
included; a file with separate attn_q / attn_k / attn_v is not one llama.cpp runs as these archs, and is refused, as
are key / value heads the models cannot hold (GPT-2 has as many as query heads, GPTBigCode one or as many).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps
from flashllm.models.gguf.reader import GGUFFile

GPT2, STARCODER = "gpt2", "starcoder"
POSITIONS = "position_embd.weight"
# GGUF non-layer tensor -> checkpoint parameter (ArchMap.tensor_names)
TENSOR_NAMES = {POSITIONS: "model.embed_positions.weight"}
# the tensors llama.cpp's gpt2 / starcoder loader requires (checked in the first layer) / that its graph never reads
_REQUIRED = (POSITIONS, "output_norm.bias", "blk.0.attn_norm.bias", "blk.0.attn_qkv.weight", "blk.0.attn_qkv.bias",
             "blk.0.attn_output.bias", "blk.0.ffn_norm.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias")
_UNREAD = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight")


def _common_fields(gf: GGUFFile, raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """GPT-2's config.json names for what both archs' files hold (module docstring); ModelLoadError (one line) for a
    file llama.cpp would not load or would run otherwise."""
    eps = layer_norm_eps(gf, arch)
    check_tensors(gf, arch, _REQUIRED, _UNREAD)
    shape = gf.tensors[POSITIONS].shape  # ggml order: (hidden, positions)
    positions = raw["max_position_embeddings"]
    if len(shape) != 2 or int(shape[0]) != raw["hidden_size"] or int(shape[1]) != positions:
        raise ModelLoadError(f"{gf.name}: {POSITIONS} has shape {tuple(int(n) for n in shape)} (ggml order); "
                             f"llama.cpp's {arch} loader requires ({raw['hidden_size']}, {positions}): one row per "
                             f"position of {arch}.context_length")
    return {"n_embd": raw["hidden_size"], "n_layer": raw["num_hidden_layers"], "n_head": raw["num_attention_heads"],
            "n_positions": positions, "n_inner": raw["intermediate_size"], "layer_norm_epsilon": eps,
            "scale_attn_weights": True}


def gpt2_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GPT2LMHeadModel config.json fields of a `gpt2` file (module docstring): multi-head, gelu_new (ggml's tanh
    GELU), no per-layer score scaling."""
    fields = _common_fields(gf, raw, GPT2)
    heads = raw["num_attention_heads"]
    if raw["num_key_value_heads"] != heads:
        raise ModelLoadError(f"{gf.name}: {raw['num_key_value_heads']} key / value heads for {heads} query heads; "
                             "GPT-2 has no grouped-query or multi-query attention")
    return {**fields, "activation_function": "gelu_new", "scale_attn_by_inverse_layer_idx": False}


def starcoder_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GPTBigCodeForCausalLM config.json fields of a `starcoder` file (module docstring): multi_query where the
    file has one key / value head (as the converter writes), gelu_pytorch_tanh (ggml's tanh GELU)."""
    fields = _common_fields(gf, raw, STARCODER)
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    if kv_heads not in (1, heads):
        raise ModelLoadError(f"{gf.name}: {kv_heads} key / value heads for {heads} query heads; GPTBigCode has one "
                             "(multi_query) or as many as query heads, no grouped-query attention")
    return {**fields, "activation_function": "gelu_pytorch_tanh", "multi_query": kv_heads == 1}
