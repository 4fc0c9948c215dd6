"""GPT-NeoX GGUF files (`gptneox`: Pythia, GPT-NeoX-20B, Dolly v2, RedPajama-INCITE): run as flashllm's
GPTNeoXForCausalLM.

What llama.cpp does with them (src/models/gptneox.cpp, the converter's GPTNeoXModel): LayerNorms with a bias
(`attn_norm`, `ffn_norm`, `output_norm`, eps `gptneox.attention.layer_norm_epsilon`); one `attn_qkv` weight and bias
whose rows the converter regrouped from the checkpoint's head-by-head [q | k | v] triples into all query rows, then all
key rows, then all value rows (each in head order), which the graph views back as q, k and v; NEOX rotary (rows as in
the checkpoint) over the first `gptneox.rope.dimension_count` features of each head, base `rope.freq_base` (10000 where
the file has none: the converter writes none); `attn_output` with a bias; the ungated MLP ffn_down(gelu(ffn_up(x)))
with biases and ggml's tanh-approximated GELU (whatever the checkpoint's hidden_act); `gptneox.use_parallel_residual`
(a required key) choosing x + attn(attn_norm(x)) + mlp(ffn_norm(x)) or the sequential block; an `output` head, which
the loader requires (never tied to the embedding). Every one of those tensors is required, biases included; a file
with separate attn_q / attn_k / attn_v, key / value heads fewer than the query heads, or no use_parallel_residual is
not one llama.cpp runs as GPT-NeoX, and is refused.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.graph_checks import check_tensors, layer_norm_eps, rotary_factor
from flashllm.models.gguf.reader import GGUFFile

ARCH = "gptneox"
# the tensors llama.cpp's gptneox loader requires (checked in the first layer) / that its graph never reads
_REQUIRED = ("output.weight", "output_norm.bias", "blk.0.attn_norm.bias", "blk.0.attn_qkv.weight",
             "blk.0.attn_qkv.bias", "blk.0.attn_output.bias", "blk.0.ffn_norm.weight", "blk.0.ffn_norm.bias",
             "blk.0.ffn_up.bias", "blk.0.ffn_down.bias")
_UNREAD = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight")


def gptneox_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GPTNeoXForCausalLM config.json fields of a `gptneox` file (module docstring): the legacy rotary_pct /
    rotary_emb_base that GPTNeoXConfig reads, since its parser takes no top-level rope_theta."""
    eps = layer_norm_eps(gf, ARCH)
    parallel = gf.get(f"{ARCH}.use_parallel_residual")
    if not isinstance(parallel, bool):
        raise ModelLoadError(f"{gf.name}: {ARCH}.use_parallel_residual is {parallel!r}; llama.cpp's {ARCH} loader "
                             "requires it (true or false)")
    check_tensors(gf, ARCH, _REQUIRED, _UNREAD)
    heads = raw["num_attention_heads"]
    if raw["num_key_value_heads"] != heads:
        raise ModelLoadError(f"{gf.name}: {raw['num_key_value_heads']} key / value heads for {heads} query heads; "
                             "GPT-NeoX has no grouped-query attention")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    return {"layer_norm_eps": eps, "use_parallel_residual": parallel, "rotary_pct": rotary_factor(gf, ARCH, head_dim),
            "rotary_emb_base": raw["rope_theta"], "hidden_act": "gelu_pytorch_tanh", "attention_bias": True,
            "tie_word_embeddings": False}
