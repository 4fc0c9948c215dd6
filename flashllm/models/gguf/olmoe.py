"""OLMoE GGUF files (`olmoe`, OLMoE-1B-7B): run as flashllm's OlmoeForCausalLM.

What llama.cpp does with them (src/models/olmoe.cpp: its hparams, tensors and graph; the converter's OlmoeModel):

- Attention: `attn_q` / `attn_k` / `attn_v` / `attn_output` without biases (the graph multiplies by the weights
  alone, even where a file holds q / k / v biases); `attn_q_norm` and `attn_k_norm`, each of `embedding_length`
  features, RMS-normalize the whole query and key projections (all heads together, OLMo 2's way) before RoPE. RoPE
  is neox (half-split pairs), and the converter leaves Q/K rows as in the checkpoint. The k norm's size makes the
  key projection as wide as the query one: the loader takes as many key heads as query heads only.
- MoE in every layer: the router `ffn_gate_inp`, experts `ffn_{gate,up,down}_exps` of `feed_forward_length`
  features (`expert_count`, `expert_used_count`); softmax over all experts, the top-k weights never renormalized
  (the graph hard-codes both, whatever `expert_gating_func` or `expert_weights_norm` say), no shared expert.
- `output.weight` is required (the head is never tied to `token_embd`); the converter writes the RMS epsilon as
  1e-5 whatever the checkpoint's `rms_norm_eps` is, and the graph reads the file's.

A file with attention biases is refused (llama.cpp would drop them), as are files llama.cpp's olmoe loader rejects
(fewer key heads than query heads, a head size other than embedding_length / head_count, no `output.weight`).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

ARCH = "olmoe"
BIAS_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output")


def olmoe_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The OlmoeForCausalLM config.json fields of an `olmoe` file beside moe.py's experts (module docstring)."""
    biased = [f"blk.0.{part}.bias" for part in BIAS_PARTS if f"blk.0.{part}.bias" in gf.tensors]
    if biased:
        raise ModelLoadError(f"{gf.name} holds {biased[0]}; llama.cpp's olmoe graph adds no attention biases, so it "
                             "runs such a file differently from the checkpoint")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    if raw["num_key_value_heads"] != heads:
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.head_count_kv={raw['num_key_value_heads']} differs from "
                             f"head_count={heads}; llama.cpp's olmoe loader takes attn_k_norm of embedding_length "
                             "features, as many key heads as query heads")
    if raw.get("head_dim", hidden // heads) * heads != hidden:
        raise ModelLoadError(f"{gf.name}: {heads} heads of {raw['head_dim']} features do not make embedding_length "
                             f"{hidden}; llama.cpp's olmoe loader takes attn_output of embedding_length squared")
    if raw["tie_word_embeddings"]:
        raise ModelLoadError(f"{gf.name} has no output.weight, which llama.cpp's olmoe loader requires (it does not "
                             "tie the head to token_embd); the file is incomplete, re-convert it")
    return {"norm_topk_prob": False}
