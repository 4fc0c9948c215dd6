"""Fields that decoder config.json files share under transformers' names, parsed one way for every family."""

from __future__ import annotations

from typing import Any

from flashllm.models.hf_config import (
    MAX_HEAD_DIM,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_POSITION_EMBEDDINGS,
    MAX_VOCAB_SIZE,
    ModelLoadError,
    checkpoint_dtype,
    flag,
    positive_int,
    token_ids,
)


def decoder_sizes(raw: dict[str, Any], source: str, max_position_default: int = 2048) -> dict[str, int]:
    """The sizes of a decoder with grouped-query attention, under transformers' field names, validated:
    hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads
    (default: the head count), head_dim (default hidden_size / heads), vocab_size and
    max_position_embeddings (default `max_position_default`, the family's transformers default).

    Raises ModelLoadError (one line) on a missing or non-positive required size, one past the
    sanity limits, or head counts that do not divide (hidden_size by heads without a head_dim,
    heads by KV heads).
    """
    hidden = positive_int(raw, "hidden_size", None, MAX_HIDDEN_SIZE, source)
    num_heads = positive_int(raw, "num_attention_heads", None, MAX_NUM_HEADS, source)
    num_kv_heads = positive_int(raw, "num_key_value_heads", num_heads, MAX_NUM_HEADS, source)
    if raw.get("head_dim") is None and hidden % num_heads != 0:
        raise ModelLoadError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={num_heads} "
                             "and head_dim is not given")
    if num_heads % num_kv_heads != 0:
        raise ModelLoadError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}; each key/value head serves an equal group of "
                             "query heads")
    return {
        "hidden_size": hidden,
        "intermediate_size": positive_int(raw, "intermediate_size", None, MAX_INTERMEDIATE_SIZE, source),
        "num_hidden_layers": positive_int(raw, "num_hidden_layers", None, MAX_NUM_LAYERS, source),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": positive_int(raw, "head_dim", hidden // num_heads, MAX_HEAD_DIM, source),
        "vocab_size": positive_int(raw, "vocab_size", None, MAX_VOCAB_SIZE, source),
        "max_position_embeddings": positive_int(raw, "max_position_embeddings", max_position_default,
                                                MAX_POSITION_EMBEDDINGS, source),
    }


def checkpoint_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """What a config.json says about its checkpoint rather than its shape, validated: torch_dtype (None
    when not said), bos_token_id and eos_token_id (an id, a list of ids or None) and tie_word_embeddings."""
    return {
        "torch_dtype": checkpoint_dtype(raw, source),
        "bos_token_id": token_ids(raw, "bos_token_id", source),
        "eos_token_id": token_ids(raw, "eos_token_id", source),
        "tie_word_embeddings": flag(raw, "tie_word_embeddings", source),
    }
