"""Tiny first-generation Qwen (QWenLMHeadModel) and Baichuan checkpoints, written from transformers' Qwen2 / Llama
weights under the remote-code models' own names and config.json fields, so that transformers can check them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# transformers Qwen2 module (after "model.layers.L.") -> QWen's (after "transformer.h.L.")
_QWEN_LAYER_NAMES = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"),
                     ("self_attn.o_proj", "attn.c_proj"), ("mlp.gate_proj", "mlp.w2"), ("mlp.up_proj", "mlp.w1"),
                     ("mlp.down_proj", "mlp.c_proj"))
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def qwen_tensors(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """transformers Qwen2 weights (as many key/value heads as query heads, untied) under QWen's names: q/k/v weights
    and biases concatenated into c_attn, gate -> w2, up -> w1."""
    out = {"transformer.wte.weight": state["model.embed_tokens.weight"],
           "transformer.ln_f.weight": state["model.norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.c_attn.{kind}"] = torch.cat([state[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv"])
        for theirs, ours in _QWEN_LAYER_NAMES:
            out[f"{dst}{ours}.weight"] = state[f"{src}{theirs}.weight"]
    return out


def qwen_from_qwen2(qwen2_dir: Path, out_dir: Path, **config: Any) -> Path:
    """The transformers Qwen2 directory `qwen2_dir` rewritten as a QWen checkpoint (its tokenizer files copied),
    seq_length its context, logn attention and dynamic NTK off unless `config` says otherwise."""
    source = json.loads((qwen2_dir / "config.json").read_text())
    if source.get("num_key_value_heads", source["num_attention_heads"]) != source["num_attention_heads"]:
        raise ValueError("QWen has as many key/value heads as query heads; build the Qwen2 model so")
    tensors = qwen_tensors(load_file(qwen2_dir / "model.safetensors"), source["num_hidden_layers"])
    context = source["max_position_embeddings"]
    raw = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "hidden_size": source["hidden_size"],
           "num_attention_heads": source["num_attention_heads"], "num_hidden_layers": source["num_hidden_layers"],
           "intermediate_size": 2 * source["intermediate_size"], "kv_channels": source["hidden_size"] //
           source["num_attention_heads"], "layer_norm_epsilon": source["rms_norm_eps"],
           "rotary_emb_base": source.get("rope_theta", 10000.0), "rotary_pct": 1.0, "seq_length": context,
           "max_position_embeddings": context, "use_dynamic_ntk": False, "use_logn_attn": False, "no_bias": True,
           "vocab_size": source["vocab_size"], "tie_word_embeddings": False, **config}
    return _write(out_dir, tensors, raw, qwen2_dir)


def write_baichuan(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                   tokenizer_from: Path | None = None) -> Path:
    """A BaichuanForCausalLM directory of `tensors` and `config` (over Baichuan's architecture and token ids)."""
    raw = {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, **config}
    return _write(out_dir, tensors, raw, tokenizer_from)


def baichuan_from_llama(llama_dir: Path, out_dir: Path, **config: Any) -> Path:
    """A Llama checkpoint rewritten as Baichuan's: q, k, v rows fused into W_pack, Baichuan's config.json (its
    tokenizer files copied)."""
    llama = load_file(llama_dir / "model.safetensors")
    tensors = {}
    for name, tensor in llama.items():
        if name.endswith("q_proj.weight"):
            prefix = name.removesuffix("q_proj.weight")
            tensors[f"{prefix}W_pack.weight"] = torch.cat([llama[f"{prefix}{p}_proj.weight"] for p in "qkv"])
        elif not name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensor
    llama_config = json.loads((llama_dir / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "rms_norm_eps", "max_position_embeddings", "hidden_act")
    return write_baichuan(out_dir, tensors, {**{k: llama_config[k] for k in keys}, **config}, llama_dir)


def _write(out_dir: Path, tensors: dict[str, torch.Tensor], raw: dict[str, Any], tokenizer_from: Path | None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(raw))
    for name in _TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out_dir / name)
    return out_dir
