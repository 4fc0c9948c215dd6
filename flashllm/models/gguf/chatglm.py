"""ChatGLM3 / GLM-4 GGUF files (`chatglm`) and GLM-4-0414 ones (`glm4`): run as transformers' GlmForCausalLM /
Glm4ForCausalLM (flashllm's GLM decoder).

What llama.cpp does with a `chatglm` file (src/models/chatglm.cpp, its hparams and tensors in src/llama-model.cpp,
convert_hf_to_gguf.py's ChatGLMModel, which converts ChatGLMModel and GlmForCausalLM checkpoints alike):

- Attention: `attn_qkv` (ChatGLM's query_key_value: q rows, then k, then v, with an optional bias) or `attn_q`,
  `attn_k`, `attn_v` (GlmForCausalLM's, each with an optional bias); `attn_output` has no bias. RoPE turns the
  first `rope.dimension_count` features of each head (the converter writes half the head) in adjacent pairs
  (llama.cpp's "normal" rope, GLM's own), with base `rope.freq_base` (10000 x ChatGLM's rope_ratio); Q/K rows
  are as in the checkpoint. The head size is embedding_length / head_count; `attention.head_count_kv` is
  ChatGLM's multi_query_group_num.
- MLP: `ffn_up` is ChatGLM's dense_h_to_4h / GLM's gate_up_proj (gate rows, then up: the graph's SwiGLU takes
  silu of the first half times the second), `ffn_down` the down projection; `output_norm` is always applied.
- Vocabulary: GLM-4's byte-level BPE with the `chatglm-bpe` pre-tokenizer (the llama3 split), or ChatGLM3's
  SentencePiece; the converter writes add_bos_token false (GLM's chat template starts with [gMASK]<sop>).
- `glm4` (src/models/glm4.cpp, the converter's Glm4Model) is the same graph with an RMSNorm after attention
  (`post_attention_norm`) and one after the MLP (`post_ffw_norm`), each before its residual add, and the same
  adjacent-pair rope unless `rope.dimension_sections` asks for GLM-4V's M-RoPE (refused here).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

LAYER_NAMES = {"ffn_up": "mlp.gate_up_proj"}
GLM4_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_self_attn_layernorm",
                    "post_ffw_norm": "post_mlp_layernorm"}


def fused_rows(config: Any) -> dict[str, tuple[tuple[str, int], ...]]:
    """`attn_qkv` -> q, k and v rows (ChatGLM's query_key_value order)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"attn_qkv": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv))}


def chatglm_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The GlmForCausalLM config.json fields of a `chatglm` file (glm_fields)."""
    return {"architectures": ["GlmForCausalLM"], "model_type": "glm", **glm_fields(gf, raw, "chatglm")}


def glm4_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Glm4ForCausalLM config.json fields of a `glm4` file (glm_fields); M-RoPE sections are refused."""
    if gf.get("glm4.rope.dimension_sections") is not None:
        raise ModelLoadError(f"{gf.name}: glm4.rope.dimension_sections is set (GLM-4V's M-RoPE); flashllm runs the "
                             "text models' plain rope")
    return {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", **glm_fields(gf, raw, "glm4")}


def glm_fields(gf: GGUFFile, raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The head size, the rotary part and whether q, k, v carry biases, from either GLM arch's file."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope = gf.get(f"{arch}.rope.dimension_count", head_dim // 2)
    if isinstance(rope, bool) or not isinstance(rope, int) or not 0 < rope <= head_dim or rope % 2:
        raise ModelLoadError(f"{gf.name}: {arch}.rope.dimension_count is {rope!r}; expected an even number of "
                             f"features in 1..{head_dim} (the head size)")
    if gf.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{gf.name}: {arch}.rope.scaling.type is set; llama.cpp's {arch} graph and flashllm's "
                             "GLM run plain rope here")
    biases = {name for name in ("blk.0.attn_qkv.bias", "blk.0.attn_q.bias") if name in gf.tensors}
    return {"head_dim": head_dim, "partial_rotary_factor": rope / head_dim, "attention_bias": bool(biases)}
