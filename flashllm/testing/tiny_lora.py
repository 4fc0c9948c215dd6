"""PEFT LoRA adapters with random weights for tests (made by peft itself) and benchmarks (written directly)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def build_peft_adapter(model_dir: str | Path, out_dir: str | Path, *, r: int = 8, alpha: float = 16,
                       targets: Sequence[str] = ALL_TARGETS, use_rslora: bool = False, seed: int = 0,
                       std: float = 0.1) -> Path:
    """Wrap the transformers model in `model_dir` with peft's LoraConfig and save the adapter to out_dir.

    lora_A and lora_B are both redrawn from N(0, std) (peft starts B at zero, which would hide
    any mistake in B or the scale). Needs `peft` (the test extra). Returns out_dir.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        lora_dropout=0.1, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "lora_A" in name or "lora_B" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def load_peft_model(model_dir: str | Path, adapter_dir: str | Path) -> Any:
    """transformers model from model_dir with the adapter applied by peft (unmerged), float32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def build_random_adapter(out_dir: str | Path, shapes: dict[str, tuple[int, int]], *, r: int = 16,
                         alpha: float = 32, seed: int = 0, std: float = 0.02) -> Path:
    """Write a PEFT-format adapter without peft: {checkpoint weight name (`....q_proj.weight`): (out, in)}.

    For benchmarks at full model shapes, where building the transformers model would cost minutes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (out_features, in_features) in shapes.items():
        module = name.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, in_features, generator=gen) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, r, generator=gen) * std
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    targets = sorted({name.removesuffix(".weight").rsplit(".", 1)[-1] for name in shapes})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
              "use_rslora": False, "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


@torch.no_grad()
def greedy_reference(model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by repeated full forwards of a transformers (or peft) model: (tokens, the final
    forward's logits (len(prompt) + steps, vocab)), independent of any cache code."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):], model(input_ids=torch.tensor([ids])).logits[0]
