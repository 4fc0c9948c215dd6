"""GGUF export of Apertus checkpoints (ApertusForCausalLM) as llama.cpp's converter writes `apertus` files: Llama's
tensor names with `attention_layernorm` / `feedforward_layernorm` as attn_norm / ffn_norm and the per-head q / k norms
as attn_q_norm / attn_k_norm, Q/K rows as in the checkpoint (the graph rotates halves), llama3 RoPE as the rope_freqs
tensor, and each layer's xIELU scalars (`mlp.act_fn.alpha_p` / `alpha_n` / `beta` / `eps`) not as tensors but as the
metadata arrays `xielu.alpha_p` / ... of one value per layer. It refuses what llama.cpp would run differently from the
checkpoint, or not load (flashllm.models.gguf.apertus says how a file runs): attention biases (its graph adds only the
output projection's) and a tied head (its loader requires output.weight)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flashllm.models.gguf.apertus import XIELU_SCALARS

ARCHITECTURE = "ApertusForCausalLM"
LAYER_NAMES = {"attention_layernorm": "attn_norm", "feedforward_layernorm": "ffn_norm"}
_ACT = ".mlp.act_fn."

Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def check(config: Any) -> None:
    """ValueError for what llama.cpp's apertus graph or loader would run differently (module docstring)."""
    refusals = {
        "attention_bias=true": (config.attention_bias, "its apertus graph adds no q / k / v biases"),
        "tie_word_embeddings=true": (config.tie_word_embeddings, "its apertus loader requires output.weight"),
    }
    for what, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"Apertus with {what} has no GGUF export here: llama.cpp would not run it as the "
                             f"checkpoint does ({why})")


def transform(entries: list[Entry], config: Any) -> Iterator[Entry]:
    """The checkpoint's entries less the xIELU scalars, which checkpoint_hparams writes as metadata."""
    return (entry for entry in entries if _ACT not in entry[0])


def checkpoint_hparams(writer: Any, model_dir: Path, config: Any) -> None:
    """Each layer's xIELU scalars as the converter writes them: `xielu.<name>`, one float per layer, in layer order."""
    from safetensors import safe_open

    values: dict[str, float] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            values |= {name: float(fh.get_tensor(name).float().item()) for name in fh.keys() if _ACT in name}
    for scalar in XIELU_SCALARS:
        per_layer = [values.get(f"model.layers.{layer}{_ACT}{scalar}") for layer in range(config.num_hidden_layers)]
        if None in per_layer:
            raise ValueError(f"{model_dir} lacks model.layers.{per_layer.index(None)}{_ACT}{scalar}; is it a complete "
                             "Apertus checkpoint?")
        getattr(writer, f"add_xielu_{scalar}")(per_layer)
