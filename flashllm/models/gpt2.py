"""GPT-2 (`GPT2LMHeadModel`: gpt2, distilgpt2, gpt2-medium / large / xl and their fine-tunes), as transformers'
GPT2Config / GPT2LMHeadModel read and run it: GPTBigCode's block with multi-head attention (flashllm.models.gpt_bigcode:
learned absolute positions `wpe`, biased LayerNorms, a fused biased `attn.c_attn`, the ungated MLP with biases, a head
tied to `wte`), `gelu_new` by default, and its projections stored as `Conv1D` weights, (in, out), transposed as they
load. c_attn's rows are [q | k | v], each n_embd wide. `scale_attn_by_inverse_layer_idx` divides layer i's score
scale by i + 1; `reorder_and_upcast_attn` only changes how transformers' eager attention rounds in half precision
(flashllm's scores and softmax run in fp32). Checkpoints are read with or without the `transformer.` prefix (the
original gpt2 files have none) and their causal-mask buffers are skipped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from flashllm.models.base import CausalLM
from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.gpt_bigcode import (
    FUSED_C_ATTN,
    GPT_BIGCODE_DEFAULTS,
    GPTBigCodeForCausalLM,
    GPTBigCodeModel,
    gpt2_style_fields,
)
from flashllm.models.hf_config import flag
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.layers.prequantized import split_output_features
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' GPT2Config defaults where config.json leaves a field out (GPTBigCodeConfig's, but gelu_new and no MQA)
GPT2_DEFAULTS: dict[str, Any] = {
    **{key: value for key, value in GPT_BIGCODE_DEFAULTS.items() if key != "multi_query"},
    "activation_function": "gelu_new", "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
}
_CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # stored (in, out)


def parse_gpt2_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig (gpt2_style_fields), as many key / value heads as query heads;
    `scale_attn_weights`, `scale_attn_by_inverse_layer_idx` and `reorder_and_upcast_attn` stay in `raw`, validated.
    Raises ModelLoadError (one line)."""
    view = {key: value for key, value in gpt2_style_fields(raw, GPT2_DEFAULTS, "GPT-2", source).items()
            if key != "multi_query"}  # GPT2Config has none: always multi-head
    flag(view, "scale_attn_by_inverse_layer_idx", source)
    flag(view, "reorder_and_upcast_attn", source)
    view["num_key_value_heads"] = view["num_attention_heads"]
    return parse_llama_config(view, source, activations=tuple(PLAIN_ACTIVATIONS))


class GPT2Model(GPTBigCodeModel):
    """GPTBigCode's stack, each layer's score scale divided by its index + 1 where `scale_attn_by_inverse_layer_idx`."""

    @staticmethod
    def score_scale(config: LlamaModelConfig, layer_idx: int) -> float:
        """GPTBigCode's scale, over layer_idx + 1 where config.json's `scale_attn_by_inverse_layer_idx` is true."""
        scale = GPTBigCodeModel.score_scale(config, layer_idx)
        return scale / (layer_idx + 1) if config.raw.get("scale_attn_by_inverse_layer_idx") else scale


class GPT2LMHeadModel(GPTBigCodeForCausalLM):
    """GPT-2 (module docstring): GPTBigCode's names, after a missing `transformer.` prefix is added, with every Conv1D
    weight transposed and c_attn cut into its q, k and v thirds (see gpt2_tensors)."""

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_gpt2_config)."""
        return parse_gpt2_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> GPT2Model:
        """GPT-2's stack: position embeddings, no RoPE, optionally layer-scaled scores."""
        return GPT2Model(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights over gpt2_tensors."""
        return CausalLM.load_weights(self, gpt2_tensors(weights, self.config))


def gpt2_tensors(weights: Iterable[tuple[str, Tensor]], config: LlamaModelConfig) -> Iterator[tuple[str, Tensor]]:
    """GPT-2 checkpoint tensors -> GPTBigCode's names and layouts: `transformer.` put before a name without it (but
    `lm_head.weight`, and flashllm's own `model.` names, which a GGUF file's tensors load under), each Conv1D weight
    (in, out) transposed to (out, in), and `<layer>.attn.c_attn.{weight,bias}`, rows [q | k | v] of n_embd each,
    yielded as `<layer>.attn.{q,k,v}_proj.*`. Raises ModelLoadError naming a fused tensor of another size."""
    hidden = config.hidden_size
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.", "model.")):
            name = f"transformer.{name}"
        if name.endswith(_CONV1D_WEIGHTS) and tensor.dim() == 2:
            tensor = materialize(tensor).t()
        match = FUSED_C_ATTN.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        parts = split_output_features(name, tensor, (hidden,) * 3, None)
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
            yield f"{prefix}.{proj}.{kind}", part
