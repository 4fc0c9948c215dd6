"""First-generation Qwen GGUF files (`qwen`: Qwen-1.8B / 7B / 14B / 72B) and Baichuan ones (`baichuan`: Baichuan-7B /
13B, Baichuan2-7B / 13B): run as flashllm's Qwen2ForCausalLM and BaichuanForCausalLM.

What llama.cpp does with a `qwen` file (src/models/qwen.cpp, its hparams and tensors in src/llama-model.cpp, the
converter's QwenModel):

- `attn_qkv` is QWen's c_attn: q, k and v rows of the full hidden width each (as many key/value heads as query heads)
  with a bias; `attn_output` (c_proj) has none. RoPE over the whole head in half-split pairs (neox), base
  `rope.freq_base` (rotary_emb_base); Q/K rows as in the checkpoint.
- `feed_forward_length` is QWen's intermediate_size, twice the width of each of `ffn_up` (w1) and `ffn_gate` (w2):
  the graph computes ffn_down(silu(ffn_gate(x)) * ffn_up(x)), Qwen2's MLP.
- QWen's logn attention and dynamic NTK are not in the file and not in the graph: positions past the checkpoint's
  seq_length run plain RoPE, as in llama.cpp. So the file runs as Qwen2's decoder, and is loaded as one.

What llama.cpp does with a `baichuan` file (src/models/baichuan.cpp, src/llama-model.cpp, the converter's
BaichuanModel):

- The converter splits W_pack into `attn_q` / `attn_k` / `attn_v` (Q/K rows reordered for llama.cpp's interleaved
  rope, as for llama) and writes the rest under llama's names; no biases.
- Position encoding is decided by the layer count: 32 layers (the 7B models) rotate with RoPE; 40 layers (the 13B
  models) add ALiBi biases of maximum 8 (the standard slopes) and no RoPE; any other count runs neither, so such a
  file is refused here.
- The converter copies lm_head as stored. Baichuan2 (vocabulary 125696) normalizes its head rows at inference, and
  flashllm does so for a Baichuan2 file as for its directory; a head normalized before conversion (what Baichuan's
  README tells llama.cpp users to do) is unchanged by it, an unnormalized one is run as the model is meant to run
  (llama.cpp runs it unnormalized).
"""

from __future__ import annotations

from typing import Any

from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf.reader import GGUFFile

# block_count -> position encoding, as llama.cpp's baichuan graph picks it (LLM_TYPE_7B / LLM_TYPE_13B)
BAICHUAN_POSITIONS = {32: "rope", 40: "alibi"}


def qwen_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The Qwen2ForCausalLM config.json fields of a `qwen` file: each MLP projection half of feed_forward_length,
    as many key/value heads as query heads; refuses what the graph runs otherwise (module docstring)."""
    heads, ffn = raw["num_attention_heads"], raw["intermediate_size"]
    if raw["num_key_value_heads"] != heads:
        raise ModelLoadError(f"{gf.name}: qwen.attention.head_count_kv is {raw['num_key_value_heads']}, not "
                             f"head_count {heads}; llama.cpp's qwen graph splits attn_qkv into equal q, k and v")
    if ffn % 2:
        raise ModelLoadError(f"{gf.name}: qwen.feed_forward_length {ffn} is odd; QWen's w1 and w2 each take half")
    if any(f"blk.0.{part}.bias" in gf.tensors for part in ("attn_output", "ffn_up", "ffn_gate", "ffn_down")):
        raise ModelLoadError(f"{gf.name} holds attn_output / MLP biases, which llama.cpp's qwen graph never adds "
                             "(a QWen checkpoint with no_bias false); not supported")
    return {"intermediate_size": ffn // 2}


def baichuan_config_fields(gf: GGUFFile, raw: dict[str, Any]) -> dict[str, Any]:
    """The BaichuanForCausalLM config.json fields of a `baichuan` file: its position encoding by layer count."""
    layers = raw["num_hidden_layers"]
    position = BAICHUAN_POSITIONS.get(layers)
    if position is None:
        raise ModelLoadError(f"{gf.name} has {layers} layers; llama.cpp's baichuan graph rotates 32-layer files "
                             "(7B) and adds ALiBi to 40-layer ones (13B), and runs any other without position "
                             "information, so it is refused")
    if position == "alibi" and raw.get("rope_scaling") is not None:
        raise ModelLoadError(f"{gf.name}: a 40-layer (ALiBi) baichuan file has rope scaling metadata; ALiBi has no "
                             "rotary embedding to scale")
    return {"position_embedding": position, "model_max_length": raw["max_position_embeddings"]}
