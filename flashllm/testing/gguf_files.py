"""Write GGUF files from tiny Hugging Face model directories as llama.cpp's converter lays them out, for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

# transformers name (after "model.layers.N.") -> llama.cpp name (after "blk.N.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def interleave_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's Q/K rows: per head, rows i and i + d/2 become 2i and 2i + 1."""
    out = np.empty_like(rows)
    head_dim = rows.shape[0] // num_heads
    half = head_dim // 2
    for h in range(num_heads):
        base = h * head_dim
        for i in range(half):
            out[base + 2 * i] = rows[base + i]
            out[base + 2 * i + 1] = rows[base + half + i]
    return out


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a transformers Llama/Qwen2 tensor name."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def write_gguf(model_dir: str | Path, out_path: str | Path, qtype: str = "F32", *, tokenizer: bool = True,
               metadata: dict[str, Any] | None = None, types: dict[str, str] | None = None) -> Path:
    """Write the tiny model in `model_dir` (config.json, model.safetensors, tokenizer.json) as a GGUF file.

    qtype: "F32", "F16" or a block type of gguf.quants ("Q8_0", "Q4_0", ...) for the 2-D weights
    (norms and biases stay F32, as llama.cpp keeps them). Llama's q/k rows are interleaved for
    llama.cpp's rotary; Qwen2's are not. A tied lm_head is left out, as llama.cpp does.
    metadata: extra key -> value pairs (strings, ints, floats) written as they are.
    types: per-projection exceptions to qtype, llama.cpp's name part -> type ({"attn_v": "Q8_0"}), as
    llama.cpp's mixes (Q4_K_M) store some projections in another type.
    """
    import gguf

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    arch = "qwen2" if config["model_type"] == "qwen2" else "llama"
    writer = gguf.GGUFWriter(str(out_path), arch)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    if tokenizer:
        add_bpe_vocab(writer, model_dir, config["vocab_size"])
    for key, value in (metadata or {}).items():
        _add_value(writer, key, value)
    weights = load_file(str(model_dir / "model.safetensors"))
    for name in sorted(weights):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = weights[name].to(torch.float32).numpy()
        proj = name.rsplit(".", 2)[-2]
        if arch == "llama" and proj in ("q_proj", "k_proj"):
            array = interleave_rope_rows(array, heads if proj == "q_proj" else kv_heads)
        kind = tensor_type(gguf_name(name), qtype, types) if array.ndim == 2 else "F32"
        _add_tensor(writer, gguf, gguf_name(name), array, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def tensor_type(name: str, qtype: str, types: dict[str, str] | None) -> str:
    """The type write_gguf stores the 2-D tensor `name` ("blk.0.attn_v.weight") in."""
    parts = name.split(".")
    part = parts[2] if len(parts) > 3 else parts[0]
    return (types or {}).get(part, qtype)


def _add_tensor(writer: Any, gguf: Any, name: str, array: np.ndarray, qtype: str) -> None:
    if qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        kind = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)


def _add_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_string(key, str(value))


def add_bpe_vocab(writer: Any, model_dir: Path, rows: int, pre: str = "gpt-2") -> None:
    """tokenizer.json's byte-level BPE as a "gpt2" vocabulary of `rows` tokens (unused rows padded), with its
    special tokens as CONTROL tokens, bos/eos from tokenizer_config.json and the chat template."""
    import gguf

    data = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(rows)]
    types = [int(gguf.TokenType.UNUSED)] * rows
    for text, index in data["model"]["vocab"].items():
        tokens[index], types[index] = text, int(gguf.TokenType.NORMAL)
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    for key, add in (("eos_token", writer.add_eos_token_id), ("bos_token", writer.add_bos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if isinstance(config.get(key), str):
            add(tokens.index(config[key]))
    writer.add_add_bos_token(False)
    template = model_dir / "chat_template.jinja"
    source = template.read_text() if template.is_file() else config.get("chat_template")
    if isinstance(source, str):
        writer.add_chat_template(source)
