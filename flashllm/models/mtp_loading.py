"""Loading a checkpoint's first multi-token-prediction (MTP) layer beside its loaded model, for --speculate_method mtp:
which layer class serves which model (DeepSeek-V3: deepseek_mtp.py, GLM-4.5: glm4_moe_mtp.py) and which of the
model's embedding and LM head the layer reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashllm.models.deepseek import DeepseekV2ForCausalLM
from flashllm.models.deepseek_mtp import DeepseekMTP, NextTokenPredictor
from flashllm.models.glm4_moe import Glm4MoeForCausalLM
from flashllm.models.glm4_moe_mtp import Glm4MoeMTP
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.embedding import Vocabulary

# model class -> the class of the MTP layer its checkpoints append (a subclass of the model takes its parent's)
PREDICTORS: tuple[tuple[type[nn.Module], type[NextTokenPredictor]], ...] = (
    (DeepseekV2ForCausalLM, DeepseekMTP), (Glm4MoeForCausalLM, Glm4MoeMTP))

# the most next-token-prediction layers a config may declare (V3 and R1 ship one)
MAX_MTP_LAYERS = 8


def num_mtp_layers(config: Any) -> int:
    """config.json's num_nextn_predict_layers (0 when absent): how many MTP layers follow the decoder's.
    ModelLoadError for a value that is not an integer in 0..MAX_MTP_LAYERS."""
    value = config.raw.get("num_nextn_predict_layers", 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MTP_LAYERS:
        raise ModelLoadError(f"config.json: num_nextn_predict_layers={value!r}; expected an integer in "
                             f"0..{MAX_MTP_LAYERS}")
    return value


def predictor_class(target: nn.Module) -> type[NextTokenPredictor] | None:
    """The MTP layer class for the loaded model `target` (PREDICTORS), None for a model without one."""
    return next((predictor for model, predictor in PREDICTORS if isinstance(target, model)), None)


def reads_from_target(model_dir: str | Path, config: Any) -> tuple[bool, bool]:
    """Which of the target's (embedding, LM head) the checkpoint's first MTP layer reads: each where the layer
    has no copy of its own (config: the target's parsed config). Reads the safetensors headers only."""
    own_embedding, own_head = _own_tables(*_layer_names(model_dir, config))
    return not own_embedding, not own_head


def _layer_names(model_dir: str | Path, config: Any) -> tuple[str, set[str]]:
    """The first MTP layer's name prefix and the checkpoint's tensor names (from the safetensors headers)."""
    from flashllm.lora.merge import checkpoint_headers
    from flashllm.models.loader import safetensors_files

    return f"model.layers.{config.num_hidden_layers}.", set(checkpoint_headers(safetensors_files(model_dir))[0])


def _own_tables(prefix: str, names: set[str]) -> tuple[bool, bool]:
    """Whether the MTP layer under `prefix` has an embedding and an output head of its own."""
    return prefix + "embed_tokens.weight" in names, prefix + "shared_head.head.weight" in names


def load_mtp(model_dir: str | Path, target: Any, ops: Any, dtype: torch.dtype, device: torch.device,
             quant: Any = None, vocabulary: Vocabulary | None = None) -> NextTokenPredictor:
    """The first MTP layer of the checkpoint in model_dir, beside the loaded `target` (its config, and its
    embedding / LM head where the checkpoint has no copies: `vocabulary` where not the target's own, whole
    copies of a tensor-parallel target's), quantized like it with `quant`; its class is predictor_class(target)'s.

    ModelLoadError (one line) when config.json declares no MTP layer or the weights lack it."""
    from flashllm.models.loader import load_selected_weights

    config, predictor = target.config, predictor_class(target)
    if predictor is None or num_mtp_layers(config) < 1:
        raise ModelLoadError(f"{model_dir}: config.json declares no next-token-prediction layer "
                             "(num_nextn_predict_layers); --speculate_method mtp needs a DeepSeek-V3 or GLM-4.5 "
                             "checkpoint with its MTP weights, or use another method (ngram, draft_model)")
    prefix, names = _layer_names(model_dir, config)
    if prefix + "eh_proj.weight" not in names:
        raise ModelLoadError(f"{model_dir}: config.json declares num_nextn_predict_layers but the weights have no "
                             f"{prefix}eh_proj.weight (a checkpoint converted without its MTP layer?); "
                             "--speculate_method mtp needs them")
    own_embedding, own_head = _own_tables(prefix, names)
    mtp = predictor(config, ops, dtype, torch.device(device), target=target, own_embedding=own_embedding,
                    own_head=own_head, vocabulary=vocabulary)
    load_selected_weights(mtp, model_dir, lambda name: "layer." + name[len(prefix):] if name.startswith(prefix)
                          else None, quant)
    return mtp
