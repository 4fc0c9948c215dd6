"""GGUF export of Cohere checkpoints as llama.cpp's converter writes them: CohereForCausalLM as `command-r`,
Cohere2ForCausalLM as `cohere2`. Llama's tensor names (Command R+'s per-head q / k norms as attn_q_norm /
attn_k_norm), Q/K rows as they are (llama.cpp rotates adjacent pairs, as Cohere does), no output tensor, the norms'
eps as `attention.layer_norm_epsilon`, `logit_scale`, and for cohere2 the window; the converter writes no sliding
pattern. Refused: what the loader would run otherwise (flashllm.models.gguf.cohere says how a file runs): attention
biases, an untied LM head, q / k norms below 64 layers (or none from 64 on), rope scaling (the converter writes none),
and for cohere2 sliding layers other than three of every four."""

from __future__ import annotations

from typing import Any

from flashllm.models.gguf import cohere as rules

ARCHITECTURE = "CohereForCausalLM"
COHERE2_ARCHITECTURE = "Cohere2ForCausalLM"


def check(config: Any) -> None:
    """ValueError for what llama.cpp's command-r loader or graph would run differently (module docstring)."""
    _check_common(config, "Command R")
    if config.use_qk_norm != (config.num_hidden_layers >= rules.QK_NORM_LAYERS):
        raise ValueError(f"Command R with use_qk_norm={config.use_qk_norm} and {config.num_hidden_layers} layers has "
                         f"no GGUF export: llama.cpp's {rules.COMMAND_R} loader reads q / k norms exactly when a file "
                         f"has {rules.QK_NORM_LAYERS} layers or more")


def check_cohere2(config: Any) -> None:
    """ValueError where llama.cpp's cohere2 rule places sliding layers otherwise than the checkpoint (or as check)."""
    _check_common(config, "Cohere 2")
    expected = [t == "sliding_attention" for t in rules.layer_types(config.num_hidden_layers)]
    if [w is not None for w in config.sliding_windows] != expected:
        raise ValueError(f"Cohere 2 with sliding layers {[i for i, w in enumerate(config.sliding_windows) if w]} has "
                         f"no GGUF export: the converter writes no pattern and llama.cpp then slides layer i when i % "
                         f"{rules.SLIDING_PATTERN} < {rules.SLIDING_PATTERN - 1}")


def _check_common(config: Any, family: str) -> None:
    if config.attention_bias:
        raise ValueError(f"{family} with attention_bias has no GGUF export: llama.cpp's loader reads no projection "
                         "biases")
    if not config.tie_word_embeddings:
        raise ValueError(f"{family} with tie_word_embeddings=false has no GGUF export: llama.cpp's loader never reads "
                         "an output tensor, it reuses the embedding")
    if config.rope_scaling is not None:
        raise ValueError(f"{family} with rope_scaling has no GGUF export: the converter writes rope scaling 'none'")


def add_hparams(writer: Any, config: Any) -> None:
    """The LayerNorms' eps and the logit scale under the keys llama.cpp's loaders read."""
    writer.add_layer_norm_eps(config.rms_norm_eps)
    writer.add_logit_scale(config.logit_scale)


def add_cohere2_hparams(writer: Any, config: Any) -> None:
    """add_hparams' keys and the sliding layers' window."""
    add_hparams(writer, config)
    writer.add_sliding_window(next(w for w in config.sliding_windows if w is not None))
