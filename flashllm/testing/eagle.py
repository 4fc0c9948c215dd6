"""Tiny random EAGLE-1 heads written locally, beside a tiny Llama target, for the speculative decoding tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

INIT_STD = 0.1


# the target's output projections: attention's, the dense MLP's, each expert's (Mixtral's w2) and shared ones
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", ".w2.weight")


def _load_target(target_dir: Path, predictable: float | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The target's config.json and tensors; with `predictable`, its output projections scaled by it, written
    back in place (so its next token depends mostly on the current one)."""
    target_config = json.loads((target_dir / "config.json").read_text())
    target_file = target_dir / "model.safetensors"
    target = load_file(target_file)
    if predictable is not None:
        target = {name: t * predictable if name.endswith(_OUTPUT_PROJECTIONS) else t for name, t in target.items()}
        save_file(target, target_file, metadata={"format": "pt"})
    return target_config, target


def _head_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """The target's sizes a head's config.json repeats."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "vocab_size")
    return {key: target_config[key] for key in keys if key in target_config}


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
    out_dir, (target_config, target) = Path(out_dir), _load_target(Path(target_dir), predictable)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _head_config(target_config)
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


def build_eagle3_head(out_dir: Path, target_dir: Path, seed: int = 0, predictable: float | None = None,
                      draft_vocab: int | None = None, own_embedding: bool = False, midlayer: bool = True,
                      **config_overrides: Any) -> Path:
    """An EAGLE-3 head for the tiny Llama in target_dir, laid out as EAGLE-3 publishes them: config.json (a Llama
    config of one layer with draft_vocab_size) and model.safetensors holding fc.weight (hidden, 3 * hidden),
    midlayer.{input_layernorm,hidden_norm,self_attn,post_attention_layernorm,mlp}.* (q, k and v read 2 * hidden
    features), norm.weight, lm_head.weight (draft_vocab, hidden), d2t (draft id -> target id offsets, int64) and
    t2d (the target ids kept, bool). Every tensor random (norm scales around 1); the draft vocabulary is a
    random set of draft_vocab target ids (default 5/8 of the target's).

    own_embedding: the head also holds embed_tokens.weight (a random one; else it uses the target's).
    midlayer False: the layer's tensors are named layers.0.* instead (the other published spelling).

    predictable (a factor in (0, 1)): a head that guesses right often. The target's output projections are
    scaled by the factor in place, so its next token depends mostly on the current one, g(t). The head gets
    as many K/V heads as query heads and q = k = a constant (biases on zero weights) that RoPE makes attend to
    the same position only; v passes the normed embedding of t_{i+1} through, o_proj is the identity, and fc
    and down_proj are scaled down, so lm_head(norm(o_i)) is about the target's logits after t_{i+1}. The draft
    vocabulary then holds every g(t)."""
    import math

    out_dir, (target_config, target) = Path(out_dir), _load_target(Path(target_dir), predictable)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _head_config(target_config)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    vocab, h = config["vocab_size"], config["hidden_size"]
    draft_vocab = draft_vocab or vocab * 5 // 8
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return INIT_STD * torch.randn(*shape, generator=gen)

    keep: set[int] = set()
    if predictable is not None:
        config["num_key_value_heads"] = config["num_attention_heads"]
        config["attention_bias"] = True
        embed, norm = target["model.embed_tokens.weight"].float(), target["model.norm.weight"].float()
        normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * norm
        keep = set((normed @ target["lm_head.weight"].float().T).argmax(-1).tolist())  # g(t) for every t
    draft_vocab = max(draft_vocab, len(keep))
    others = [i for i in torch.randperm(vocab, generator=gen).tolist() if i not in keep]
    draft_ids = torch.tensor(sorted(keep | set(others[:draft_vocab - len(keep)])))
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=draft_vocab, rope_theta=target_config.get("rope_theta", 10000.0),
                  torch_dtype="float32", tie_word_embeddings=False)
    config.update(config_overrides)
    inter, heads, kv_heads = config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = {"input_layernorm.weight": 1.0 + rand(h), "hidden_norm.weight": 1.0 + rand(h),
             "self_attn.q_proj.weight": rand(q, 2 * h), "self_attn.k_proj.weight": rand(kv, 2 * h),
             "self_attn.v_proj.weight": rand(kv, 2 * h), "self_attn.o_proj.weight": rand(h, q),
             "post_attention_layernorm.weight": 1.0 + rand(h), "mlp.gate_proj.weight": rand(inter, h),
             "mlp.up_proj.weight": rand(inter, h), "mlp.down_proj.weight": rand(h, inter)}
    head_tensors = {"fc.weight": rand(h, 3 * h), "norm.weight": 1.0 + rand(h),
                    "lm_head.weight": rand(draft_vocab, h)}
    if predictable is not None:
        # q . k of one constant vector under RoPE is largest at distance 0: scaled so that any other position
        # within max_position_embeddings scores at least 30 lower (softmax weight < 1e-13)
        theta = float(config["rope_theta"])
        freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        distance = torch.arange(1, config["max_position_embeddings"], dtype=torch.float64)
        gap = (1 - torch.cos(distance[:, None] * freqs)).sum(-1).min().item() * 2 / head_dim  # per unit of |c|^2
        c = math.sqrt(30 * math.sqrt(head_dim) / (gap * head_dim)) * torch.ones(head_dim)
        layer.update({"input_layernorm.weight": torch.ones(h), "self_attn.q_proj.weight": torch.zeros(q, 2 * h),
                      "self_attn.k_proj.weight": torch.zeros(kv, 2 * h), "self_attn.q_proj.bias": c.repeat(heads),
                      "self_attn.k_proj.bias": c.repeat(kv_heads),
                      "self_attn.v_proj.weight": torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1),
                      "self_attn.v_proj.bias": torch.zeros(kv), "self_attn.o_proj.weight": torch.eye(h),
                      "self_attn.o_proj.bias": torch.zeros(h),
                      "mlp.down_proj.weight": layer["mlp.down_proj.weight"] * predictable})
        head_tensors["fc.weight"] = head_tensors["fc.weight"] * predictable
        head_tensors["norm.weight"] = target["model.norm.weight"].float().clone()
        head_tensors["lm_head.weight"] = target["lm_head.weight"].float()[draft_ids].clone()
    prefix = "midlayer." if midlayer else "layers.0."
    tensors = {**head_tensors, **{prefix + k: v for k, v in layer.items()}}
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, h)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    save_file({**{k: v.float().contiguous() for k, v in tensors.items()},
               "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d},
              out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
