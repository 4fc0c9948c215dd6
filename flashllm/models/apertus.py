"""Apertus (`ApertusForCausalLM`: swiss-ai/Apertus-8B / 70B and their -Instruct), as transformers' ApertusConfig /
ApertusForCausalLM read and run it: Llama's pre-norm block (its RMSNorms named `attention_layernorm` and
`feedforward_layernorm`) with each query and key head RMS-normed over head_dim before RoPE (Qwen3's q / k norms), and
an ungated MLP `down_proj(xielu(up_proj(x)))` whose xIELU activation has learned scalars per layer
(`mlp.act_fn.alpha_p`, `alpha_n`, `beta`, `eps`); biases on q / k / v / o where `attention_bias`.

RoPE is read as ApertusConfig reads it: `rope_parameters` (or the legacy `rope_scaling`), with `rope_theta` from
that dict, else the top-level field, else 12000000; with neither dict, llama3 scaling (factor 8 over 8192 original
positions, frequency factors 1 and 4, theta 12000000), whatever a lone top-level rope_theta says, so a lone
rope_theta other than 12000000 is refused as ambiguous. Only `hidden_act` "xielu" is run (ApertusConfig's default,
every published checkpoint's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.errors import ModelLoadError
from flashllm.models.layers.mlp import PlainMLP
from flashllm.models.llama import LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized

APERTUS_THETA = 12000000.0  # ApertusConfig.default_theta
# transformers' ApertusConfig defaults (Apertus-8B's shape) where config.json leaves a field out (Llama's differ)
APERTUS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "xielu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False,
}
# ApertusConfig.__post_init__'s rope_parameters when config.json gives none
APERTUS_ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": APERTUS_THETA, "factor": 8.0,
                                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0}


def parse_apertus_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig with ApertusConfig's defaults, per-head q / k norms, RoPE as the module
    docstring says, no MLP bias and no sliding window; a pre-quantized checkpoint is refused (quantize at load with
    --quant_type). Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    given = {**APERTUS_DEFAULTS, **raw}
    if not (given.get("rope_parameters") or given.get("rope_scaling")):
        if given.get("rope_theta") not in (None, APERTUS_THETA):
            raise ModelLoadError(f"{source}: rope_theta={given['rope_theta']!r} without rope_parameters: transformers' "
                                 f"Apertus then rotates by its llama3 default with theta {APERTUS_THETA:g}; write "
                                 "rope_parameters (or rope_scaling) with the intended rope_theta")
        given["rope_parameters"] = APERTUS_ROPE
    view = given | {"rope_theta": given.get("rope_theta") or APERTUS_THETA, "mlp_bias": False,
                    "sliding_window": None}
    config = parse_llama_config(view, source, activations=("xielu",))
    return dataclasses.replace(config, qk_norm=True, raw=raw)


def scalar_loader(param: Tensor, loaded_weight: Tensor, shard_id: Any = None) -> None:
    """Weight loader of one learned scalar, stored as a 0-d or a one-element tensor (checkpoints write both)."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not fused; got shard_id={shard_id!r}")
    if loaded_weight.numel() != 1:
        raise ValueError(f"weight has shape {tuple(loaded_weight.shape)} but the model expects one value")
    param.data.copy_(materialize(loaded_weight).reshape(param.shape))


class XIELU(nn.Module):
    """xIELU with learned scalars, as transformers' XIELUActivation computes it in Python (its optional CUDA kernel
    computes the same function): with a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n),
    x > 0: a_p x x + beta x;  else: (expm1(min(x, eps)) - x) a_n + beta x, in the dtype of x (the parameters held in
    the model dtype, as transformers' are). Elementwise, so each tensor-parallel rank runs its intermediate slice."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # checkpoint shapes: alpha_p / alpha_n (1,), beta / eps 0-d; values here are XIELUActivation's initial ones
        self.alpha_p = self._scalar(torch.log(torch.expm1(torch.tensor(0.8))), (1,), dtype, device)
        self.alpha_n = self._scalar(torch.log(torch.expm1(torch.tensor(0.3))), (1,), dtype, device)
        self.beta = self._scalar(torch.tensor(0.5), (), dtype, device)
        self.eps = self._scalar(torch.tensor(-1e-6), (), dtype, device)

    @staticmethod
    def _scalar(value: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
        param = nn.Parameter(value.to(dtype=dtype, device=device).reshape(shape), requires_grad=False)
        param.weight_loader = scalar_loader
        return param

    def forward(self, x: Tensor) -> Tensor:
        """x (T, I) -> (T, I) in x.dtype."""
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


class ApertusModel(LlamaModel):
    """Llama's stack with the ungated xIELU MLP in every layer."""

    @staticmethod
    def build_mlp(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                  tp_size: int) -> nn.Module:
        """down_proj(xielu(up_proj(x))), no biases."""
        return PlainMLP(config.hidden_size, config.intermediate_size, False, XIELU(dtype, device), ops, dtype, device,
                        tp_rank, tp_size)


class ApertusForCausalLM(LlamaForCausalLM):
    """Apertus (module docstring): Llama's checkpoint names but for the two norms, and the MLP's up_proj / down_proj
    and act_fn scalars."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    renamed_modules: ClassVar[dict[str, str]] = {".attention_layernorm.": ".input_layernorm.",
                                                 ".feedforward_layernorm.": ".post_attention_layernorm."}

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_apertus_config)."""
        return parse_apertus_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> ApertusModel:
        """Llama's stack with xIELU MLPs."""
        return ApertusModel(config, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """LlamaForCausalLM.load_weights, first taking each layer's xIELU scalars from config fields `xielu_alpha_p`,
        `xielu_alpha_n`, `xielu_beta` and `xielu_eps` (one value per layer) where the config has them: a GGUF file
        keeps them as metadata, not tensors (models/gguf/apertus.py). Checkpoint tensors of the same names follow,
        and win."""
        return super().load_weights(chain(self._config_scalars(), weights))

    def _config_scalars(self) -> Iterator[tuple[str, Tensor]]:
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            for layer, value in enumerate(self.config.raw.get(f"xielu_{name}") or ()):
                yield f"model.layers.{layer}.mlp.act_fn.{name}", torch.tensor(float(value))
