"""Tiny random EAGLE-1 heads written locally, beside a tiny Llama target, for the speculative decoding tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

INIT_STD = 0.1


def build_eagle_head(out_dir: Path, target_dir: Path, seed: int = 0, predictable: float | None = None,
                     **config_overrides: Any) -> Path:
    """An EAGLE-1 head for the tiny Llama in target_dir, laid out as EAGLE-1 publishes them: config.json (a Llama
    config with num_hidden_layers 1) and model.safetensors holding fc.weight (hidden, 2 * hidden), fc.bias,
    layers.0.{self_attn,mlp}.* and layers.0.post_attention_layernorm.weight (no input_layernorm), plus a copy
    of the target's embed_tokens.weight. Every tensor random (norm scales around 1).

    predictable (a factor in (0, 1)): a head that guesses right often, for tests that need accepted drafts.
    The target's output projections (o_proj, down_proj) are scaled by the factor in place, so its next token
    depends mostly on the current one; the head's fc is [diag(target's final norm) 0] without bias and its own
    output projections are scaled alike, so lm_head(o_i) is about the target's guess after t_{i+1}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    target_file = Path(target_dir) / "model.safetensors"
    target = load_file(target_file)
    if predictable is not None:
        target = {name: t * predictable if name.endswith(("o_proj.weight", "down_proj.weight")) else t
                  for name, t in target.items()}
        save_file(target, target_file, metadata={"format": "pt"})
    config = {key: target_config[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                                  "vocab_size") if key in target_config}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  rope_theta=target_config.get("rope_theta", 10000.0), torch_dtype="float32")
    config.update(config_overrides)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return INIT_STD * torch.randn(*shape, generator=gen)

    q, kv = heads * head_dim, kv_heads * head_dim
    layer = {"self_attn.q_proj.weight": rand(q, h), "self_attn.k_proj.weight": rand(kv, h),
             "self_attn.v_proj.weight": rand(kv, h), "self_attn.o_proj.weight": rand(h, q),
             "post_attention_layernorm.weight": 1.0 + rand(h), "mlp.gate_proj.weight": rand(inter, h),
             "mlp.up_proj.weight": rand(inter, h), "mlp.down_proj.weight": rand(h, inter)}
    tensors = {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h), **{f"layers.0.{k}": v for k, v in layer.items()},
               "embed_tokens.weight": target["model.embed_tokens.weight"].clone()}
    if predictable is not None:
        tensors["fc.weight"] = torch.cat((torch.diag(target["model.norm.weight"].float()), torch.zeros(h, h)), dim=1)
        tensors["fc.bias"] = torch.zeros(h)
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            tensors[name] = tensors[name] * predictable
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
