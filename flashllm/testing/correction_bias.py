"""Tiny MoE checkpoints with a random `e_score_correction_bias`, for tests of the sigmoid-routed families (MiniMax-M2,
EXAONE MoE): transformers initializes the bias to zeros, which would leave its part in choosing experts untested."""

from __future__ import annotations

from pathlib import Path

import torch


def redraw_correction_bias(model_dir: Path, seed: int, scale: float = 0.3, stacked: bool = False,
                           extra: dict[str, torch.Tensor] | None = None) -> None:
    """Redraw every `*e_score_correction_bias` of model_dir's model.safetensors as N(0, scale), adding the `extra`
    tensors; `stacked` first re-saves the model in transformers 5's layout (stacked experts, its tensor names)."""
    from safetensors.torch import load_file, save_file

    if stacked:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(model_dir, save_original_format=False)
    path = model_dir / "model.safetensors"
    tensors, gen = load_file(path), torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * scale
    tensors.update(extra or {})
    save_file(tensors, path, metadata={"format": "pt"})
