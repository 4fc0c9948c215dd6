"""Arcee GGUF files (`arcee`, AFM-4.5B): run as flashllm's ArceeForCausalLM.

What llama.cpp does with them (the converter's ArceeModel, a LlamaModel: Q/K rows reordered for llama.cpp's
interleaved rope; the graph's ungated MLP with a squared ReLU): Llama's tensors without `ffn_gate`, YaRN from
`arcee.rope.scaling.*` where the file has it, full attention on every layer.
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

ARCH = "arcee"


def arcee_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The ArceeForCausalLM config.json fields of an `arcee` file (module docstring)."""
    if "blk.0.ffn_gate.weight" in gf.tensors:
        raise ModelLoadError(f"{gf.name} holds blk.0.ffn_gate.weight, which llama.cpp's arcee graph never reads; the "
                             "file is not one it runs")
    return {"hidden_act": "relu2"}
