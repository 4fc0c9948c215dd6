"""SmolLM3 GGUF files (`smollm3`): run as flashllm's SmolLM3ForCausalLM.

What llama.cpp does with them (src/models/smollm3.cpp, its hparams in src/llama-model.cpp, the converter's
SmolLM3Model, a LlamaModel): Llama's tensors (Q/K rows reordered for llama.cpp's interleaved rope, as for llama) and
RoPE on every layer but each fourth one (`n_no_rope_layer_step` is hard-coded to 4: layer i rotates when
(i + 1) % 4 != 0), full attention on every layer (the graph has no sliding window).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.gguf.reader import GGUFFile

NO_ROPE_LAYER_STEP = 4  # llama.cpp's n_no_rope_layer_step for smollm3


def smollm3_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The SmolLM3ForCausalLM config.json fields of a `smollm3` file: llama.cpp's NoPE interval, no window."""
    return {"no_rope_layer_interval": NO_ROPE_LAYER_STEP, "use_sliding_window": False}
