"""GGUF export of Hunyuan MoE checkpoints (HunYuanMoEV1ForCausalLM: Hunyuan-A13B) as llama.cpp's converter writes
`hunyuan-moe` files: Llama's tensor names with `query_layernorm` / `key_layernorm` as attn_q_norm / attn_k_norm, the
router `mlp.gate.wg` as ffn_gate_inp, the shared MLP as `ffn_*_shexp`, the experts stacked, Q/K rows as in the
checkpoint, the NTK alpha folded into rope.freq_base (flashllm's rope_theta holds it), `expert_feed_forward_length`
and `expert_shared_feed_forward_length` (intermediate_size), `expert_shared_count`. It refuses what llama.cpp would
run differently from the checkpoint (flashllm.models.gguf.hunyuan_moe says how a file runs): rope scaling beyond the
alpha (its graph reads none) and a head size other than hidden_size / num_attention_heads (its converter folds the
NTK alpha over that)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE = "HunYuanMoEV1ForCausalLM"
LAYER_NAMES = {"self_attn.query_layernorm": "attn_q_norm", "self_attn.key_layernorm": "attn_k_norm",
               "mlp.gate.wg": "ffn_gate_inp", "mlp.shared_mlp.gate_proj": "ffn_gate_shexp",
               "mlp.shared_mlp.up_proj": "ffn_up_shexp", "mlp.shared_mlp.down_proj": "ffn_down_shexp"}


def check(config: Any) -> None:
    """ValueError for what llama.cpp's hunyuan-moe converter and graph would run differently (module docstring)."""
    per_head = config.hidden_size // config.num_attention_heads
    refusals = {
        f"rope scaling {config.rope_scaling!r}": (config.rope_scaling is not None,
                                                  "its hunyuan-moe graph reads no rope scaling"),
        f"head_dim={config.head_dim}": (  # the parsed config keeps no trace of an alpha, so any other size is refused
            config.head_dim != per_head,
            f"its converter folds the NTK alpha over hidden_size / num_attention_heads = {per_head} features"),
    }
    for what, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"Hunyuan MoE with {what} has no GGUF export here: llama.cpp would not run it as the "
                             f"checkpoint does ({why})")


def add_hparams(writer: Any, config: Any) -> None:
    """The expert keys llama.cpp's hunyuan-moe loader reads (the experts and the shared MLP intermediate_size wide)."""
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
