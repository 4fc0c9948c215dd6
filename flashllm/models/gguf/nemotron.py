"""Nemotron GGUF files (`nemotron`: Minitron-4B / 8B, Nemotron-Mini-4B): run as flashllm's NemotronForCausalLM.

What llama.cpp does with them (src/models/nemotron.cpp, the converter's NemotronModel): LayerNorms with biases whose
weights the converter stored as 1 + w (the loader takes the 1 back off; the model's norms add it again), eps
`nemotron.attention.layer_norm_epsilon`, NEOX rotary (Q/K rows as in the checkpoint) over the first
`rope.dimension_count` features of each head, the ungated MLP ffn_down(relu(ffn_up(x))²) with biases where the file
has them, full attention on every layer.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

ARCH = "nemotron"
NORM_OFFSET = 1.0  # the converter's + 1 on every `*norm.weight`


def nemotron_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The NemotronForCausalLM config.json fields of a `nemotron` file (module docstring)."""
    eps = gf.get(f"{ARCH}.attention.layer_norm_epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(f"{gf.name}: {ARCH}.attention.layer_norm_epsilon is {eps!r}; llama.cpp's {ARCH} graph "
                             "needs the LayerNorms' positive eps")
    if "blk.0.ffn_gate.weight" in gf.tensors:
        raise ModelLoadError(f"{gf.name} holds blk.0.ffn_gate.weight, which llama.cpp's {ARCH} graph never reads; "
                             "the file is not one it runs")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope = gf.get(f"{ARCH}.rope.dimension_count", head_dim)
    if isinstance(rope, bool) or not isinstance(rope, int) or not 0 < rope <= head_dim or rope % 2:
        raise ModelLoadError(f"{gf.name}: {ARCH}.rope.dimension_count is {rope!r}; expected an even number of "
                             f"features in 1..{head_dim} (the head size)")
    return {"norm_eps": float(eps), "partial_rotary_factor": rope / head_dim, "hidden_act": "relu2",
            "attention_bias": "blk.0.attn_q.bias" in gf.tensors, "mlp_bias": "blk.0.ffn_up.bias" in gf.tensors}
