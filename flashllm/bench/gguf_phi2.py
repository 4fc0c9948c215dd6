"""GGUF export of Phi checkpoints (PhiForCausalLM: phi-1, phi-1_5, phi-2) as llama.cpp's converter writes `phi2`
files: Llama's tensor names with the attention's `dense` as attn_output, the MLP's fc1 / fc2 as ffn_up / ffn_down,
`model.final_layernorm` as output_norm, the biases (the LM head's included) beside their weights, the norms' eps as
`attention.layer_norm_epsilon` and RoPE over `rope.dimension_count` features of each head. Refused: q / k LayerNorms
(qk_layernorm, which llama.cpp's phi2 graph never reads) and tied embeddings (its loader requires output.weight);
flashllm.models.gguf.phi2 says how a file runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

ARCHITECTURE = "PhiForCausalLM"
LAYER_NAMES = {"self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
_FINAL_NORM, _NORM = "model.final_layernorm.", "model.norm."


def check(config: Any) -> None:
    """ValueError for what llama.cpp's phi2 graph would run differently (module docstring)."""
    if config.raw.get("qk_layernorm"):
        raise ValueError("Phi with qk_layernorm has no GGUF export: llama.cpp's phi2 graph has no q / k norms")
    if config.tie_word_embeddings:
        raise ValueError("Phi with tie_word_embeddings has no GGUF export: llama.cpp's phi2 loader requires its own "
                         "output.weight")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps under the key llama.cpp's phi2 loader reads."""
    writer.add_layer_norm_eps(config.rms_norm_eps)


def transform(items: list[Any], config: Any) -> Iterator[Any]:
    """The checkpoint's entries with `model.final_layernorm` named as Llama's final norm (output_norm)."""
    for name, shape, load in items:
        yield (_NORM + name[len(_FINAL_NORM):] if name.startswith(_FINAL_NORM) else name), shape, load
