"""Baichuan / Baichuan2 config.json: Llama's fields, plus which position encoding and LM head the weights use.

The checkpoints ship their own modeling code, one file per size, and their config.json names no
position encoding, so flashllm decides from the fields the published configs carry (never by
running that code):

- `BaiChuanForCausalLM` (Baichuan-7B) uses RoPE.
- `BaichuanForCausalLM` (Baichuan-13B, Baichuan2-7B, Baichuan2-13B): RoPE when config.json has
  `max_position_embeddings` (the RoPE 7B configs size their rotary table with it), ALiBi when it
  has only `model_max_length` (the 13B configs' context length). A config whose shape is a
  published one, (hidden_size, num_hidden_layers) = (4096, 32) for RoPE or (5120, 40) for ALiBi,
  must agree with that rule; one that does not, or has neither field, is refused as ambiguous
  unless it says `"position_embedding": "rope"` or `"alibi"` itself, which then decides.
- Baichuan2's LM head normalizes its weight rows (NormHead): config.json has Baichuan2's vocabulary
  (vocab_size 125696; Baichuan 1 has 64000) or Baichuan2's `z_loss_weight` training field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from flashllm.models.hf_config import (
    MAX_HIDDEN_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    ModelLoadError,
    config_architecture,
    positive_int,
)
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

BAICHUAN_7B = "BaiChuanForCausalLM"  # Baichuan-7B, the first release
BAICHUAN = "BaichuanForCausalLM"  # Baichuan-13B, Baichuan2-7B, Baichuan2-13B
POSITION_EMBEDDINGS = ("rope", "alibi")
# (hidden_size, num_hidden_layers) of the published checkpoints -> their position encoding
PUBLISHED_SHAPES: dict[tuple[int, int], str] = {(4096, 32): "rope", (5120, 40): "alibi"}
BAICHUAN2_VOCAB_SIZE = 125696
# context of every Baichuan release, for a config that declares none
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True, slots=True)
class BaichuanModelConfig(LlamaModelConfig):
    """LlamaModelConfig plus position_embedding ("rope" | "alibi") and norm_head (Baichuan2's LM head).

    max_position_embeddings is the model's context: the RoPE table's length, or an ALiBi model's
    `model_max_length`. num_key_value_heads always equals num_attention_heads (W_pack fuses equal q, k, v).
    """

    position_embedding: str = "rope"
    norm_head: bool = False

    @property
    def alibi(self) -> bool:
        """The attention adds ALiBi biases (read by the engine to resolve attention kernels that implement them)."""
        return self.position_embedding == "alibi"


def parse_baichuan_config(raw: dict[str, Any], source: str = "config.json") -> BaichuanModelConfig:
    """Validate a Baichuan / Baichuan2 config.json dict; ModelLoadError (one line) on anything flashllm cannot run."""
    architecture = config_architecture(raw, source)
    position = _position_embedding(raw, architecture, source)
    _check_heads(raw, source)
    view = dict(raw)
    if position == "alibi":
        if raw.get("rope_scaling") is not None:
            raise ModelLoadError(f"{source}: rope_scaling is set but this {architecture} uses ALiBi, which has no "
                                 "rotary embedding to scale; remove rope_scaling")
        view["max_position_embeddings"] = _context(raw, ("model_max_length", "max_position_embeddings"), source)
    else:
        view["max_position_embeddings"] = _context(raw, ("max_position_embeddings", "model_max_length"), source)
    llama = parse_llama_config(view, source)
    norm_head = raw.get("vocab_size") == BAICHUAN2_VOCAB_SIZE or "z_loss_weight" in raw
    if norm_head and llama.tie_word_embeddings:
        raise ModelLoadError(f"{source}: tie_word_embeddings is true, but Baichuan2's LM head normalizes its rows, "
                             "which would change the embedding it shares; expected tie_word_embeddings false")
    values = {f.name: getattr(llama, f.name) for f in fields(LlamaModelConfig)}
    values["raw"] = raw
    return BaichuanModelConfig(**values, position_embedding=position, norm_head=norm_head)


def _position_embedding(raw: dict[str, Any], architecture: str, source: str) -> str:
    """"rope" or "alibi", by the rules in this module's docstring."""
    declared = raw.get("position_embedding")
    if declared is not None:
        if declared not in POSITION_EMBEDDINGS:
            raise ModelLoadError(f"{source}: position_embedding={declared!r}; expected one of {POSITION_EMBEDDINGS}")
        return declared
    if architecture == BAICHUAN_7B:
        return "rope"
    if raw.get("max_position_embeddings") is not None:
        position = "rope"
    elif raw.get("model_max_length") is not None:
        position = "alibi"
    else:
        raise ModelLoadError(f"{source}: {architecture} has neither max_position_embeddings (the RoPE 7B configs) "
                             "nor model_max_length (the ALiBi 13B configs), so its position encoding is unknown; "
                             'add "position_embedding": "rope" or "alibi"')
    shape = (positive_int(raw, "hidden_size", None, MAX_HIDDEN_SIZE, source),
             positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source))
    published = PUBLISHED_SHAPES.get(shape)
    if published is not None and published != position:
        raise ModelLoadError(f"{source}: {architecture} with hidden_size={shape[0]}, num_hidden_layers={shape[1]} "
                             f"has the shape of the published {published} checkpoints but fields of the {position} "
                             f'ones; ambiguous: add "position_embedding": "rope" or "alibi"')
    return position


def _check_heads(raw: dict[str, Any], source: str) -> None:
    heads = positive_int(raw, "num_attention_heads", None, MAX_NUM_HEADS, source)
    kv_heads = raw.get("num_key_value_heads", heads)
    if kv_heads != heads:
        raise ModelLoadError(f"{source}: num_key_value_heads={kv_heads!r} differs from num_attention_heads={heads}; "
                             "Baichuan's W_pack fuses q, k and v of equal size, so expected them equal")


def _context(raw: dict[str, Any], keys: tuple[str, str], source: str) -> int:
    """The first of `keys` config.json has, as a bounded positive int; DEFAULT_CONTEXT when it has neither."""
    for key in keys:
        if raw.get(key) is not None:
            return positive_int(raw, key, None, MAX_POSITION_EMBEDDINGS, source)
    return DEFAULT_CONTEXT
