"""Falcon GGUF files (`falcon`: Falcon-7B / 40B / 180B and their -instruct tunes, Falcon2-11B): run as flashllm's
FalconForCausalLM.

What llama.cpp does with them (src/models/falcon.cpp, the converter's FalconModel): one `attn_qkv` weight whose rows
the converter regrouped from the checkpoint's key / value groups ([the group's query heads | k | v], group by group)
into all query rows, then all key rows, then all value rows (each in head order), `attention.head_count_kv` key / value
heads (the converter's num_kv_heads, else 1); LayerNorms with a bias (eps `falcon.attention.layer_norm_epsilon`, which
the loader requires); the parallel block x + attn(n(x)) + mlp(m(x)) always, where m is `attn_norm` and n is
`attn_norm_2` where the file has it (40B / 180B's ln_mlp and ln_attn) and `attn_norm` otherwise (7B's and Falcon2's one
input_layernorm); NEOX rotary over whole heads (n_rot must be the head size), base `rope.freq_base` (10000 where the
file has none: the converter writes none); `attn_output`, the ungated MLP ffn_down(gelu(ffn_up(x))) with ggml's
tanh-approximated GELU, all without biases; an `output` head where the file has one, else the embedding (tied).
Refused: a file with biases on its projections or separate attn_q / attn_k / attn_v (the loader does not read them),
one without `attn_qkv`, the LayerNorms' biases or their eps, or with half of an attn_norm_2. Falcon-RW (ALiBi, one key /
value head per query head, the sequential block) has no counterpart in llama.cpp's falcon graph: such a checkpoint's
file would run RoPE over a wrong head layout, and bench/gguf_falcon.py refuses to write one.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps
from flashllm.models.gguf.reader import GGUFFile

ARCH = "falcon"
# the tensors llama.cpp's falcon loader requires (checked in the first layer) / that it never reads
_REQUIRED = ("output_norm.bias", "blk.0.attn_norm.weight", "blk.0.attn_norm.bias", "blk.0.attn_qkv.weight",
             "blk.0.attn_output.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")
_UNREAD = ("blk.0.attn_qkv.bias", "blk.0.attn_output.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias",
           "blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_norm.weight")
_SECOND_NORM = ("blk.0.attn_norm_2.weight", "blk.0.attn_norm_2.bias")


def falcon_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The FalconForCausalLM config.json fields of a `falcon` file (module docstring), under FalconConfig's names:
    7B's multi-query layout for one key / value head and one norm, else the new decoder architecture with the file's
    key / value heads and one norm or two."""
    eps = layer_norm_eps(gf, ARCH)
    check_tensors(gf, ARCH, _REQUIRED, _UNREAD)
    second = [name in gf.tensors for name in _SECOND_NORM]
    if any(second) and not all(second):
        raise ModelLoadError(f"{gf.name} holds only one of {' and '.join(_SECOND_NORM)}; Falcon-40B's second "
                             "LayerNorm needs both")
    kv_heads = raw["num_key_value_heads"]
    if kv_heads == 1 and not any(second):
        layout: dict[str, Any] = {"new_decoder_architecture": False, "multi_query": True}
    else:
        layout = {"new_decoder_architecture": True, "num_kv_heads": kv_heads,
                  "num_ln_in_parallel_attn": 2 if all(second) else 1}
    return {**layout, "layer_norm_epsilon": eps, "ffn_hidden_size": raw["intermediate_size"],
            "activation": "gelu_pytorch_tanh", "bias": False, "alibi": False, "parallel_attn": True}


def fused_rows(config: Any) -> dict[str, tuple[tuple[str, int], ...]]:
    """`attn_qkv` -> q, k and v rows (the converter's [all q | all k | all v]); in the two-norm layout also the norms'
    roles, which depend on it: `attn_norm` (ln_mlp) feeds the MLP and `attn_norm_2` (ln_attn) the attention."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    rows = {"attn_qkv": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv))}
    if config.num_ln_in_parallel_attn == 2:
        hidden = config.hidden_size
        rows |= {"attn_norm": (("post_attention_layernorm", hidden),),
                 "attn_norm_2": (("input_layernorm", hidden),)}
    return rows
