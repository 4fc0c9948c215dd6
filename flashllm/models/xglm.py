"""XGLM (`XGLMForCausalLM`: facebook/xglm-564M / 1.7B / 2.9B / 4.5B / 7.5B), as transformers' XGLMConfig /
XGLMForCausalLM read and run it: OPT's pre-norm stack (flashllm.models.opt: separate biased q / k / v and `out_proj`,
scores scaled by head_dim ** -0.5, the biased ungated MLP `fc2(act(fc1(x)))` of `ffn_dim` features, GELU by default,
LayerNorms with eps 1e-5, a final LayerNorm `model.layer_norm`, a head tied to the token embeddings unless config.json
says otherwise) with fixed sinusoidal positions in place of a learned table: position p reads row p + 2 of
[sin | cos] over hidden_size / 2 frequencies 10000 ** (-i / (hidden_size / 2 - 1)), the row `pad_token_id` zeroed (as
transformers builds it), added to the token embeddings, which are multiplied by sqrt(d_model) (a Python float, not
rounded to the model dtype) where `scale_embedding` (the default). Sizes are read under XGLMConfig's names (`d_model`,
`num_layers`, `attention_heads`) or the generic ones its attribute_map takes. `add_cross_attention` is refused;
dropouts and layerdrop are training-only."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.gemma3 import ScaledVocabEmbedding
from flashllm.models.hf_config import flag
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.opt import OPT_POSITION_OFFSET, OPTForCausalLM, OPTModel, parse_opt_config

# transformers' XGLMConfig defaults where config.json leaves a field out (xglm-564M's shape), under the generic names
XGLM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256008, "max_position_embeddings": 2048, "hidden_size": 1024, "ffn_dim": 4096,
    "num_hidden_layers": 24, "num_attention_heads": 16, "activation_function": "gelu", "scale_embedding": True,
    "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": True,
}
_XGLM_NAMES = {"d_model": "hidden_size", "num_layers": "num_hidden_layers", "attention_heads": "num_attention_heads"}
# OPT's switches, as XGLM's one block has them (config.json's values of these names are not XGLM's: ignored)
_AS_OPT = {"do_layer_norm_before": True, "_remove_final_layer_norm": False, "enable_bias": True,
           "layer_norm_elementwise_affine": True}


def parse_xglm_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig through parse_opt_config (XGLM's names and defaults read as OPT's fields, its
    block fixed as _AS_OPT); `scale_embedding` stays in `raw`, validated. Raises ModelLoadError (one line)."""
    given = {key: value for key, value in raw.items() if value is not None and key != "word_embed_proj_dim"}
    given |= {generic: given[name] for name, generic in _XGLM_NAMES.items() if name in given}
    fields = {**XGLM_DEFAULTS, **given, **_AS_OPT}
    if flag(fields, "add_cross_attention", source):
        raise ModelLoadError(f"{source}: add_cross_attention=true is an encoder-decoder's cross-attention; flashllm "
                             "runs XGLM as a decoder only (set it false)")
    fields["scale_embedding"] = flag(fields, "scale_embedding", source)
    return parse_opt_config(fields, source, XGLM_DEFAULTS, "XGLM")


class SinusoidalPositionEmbedding(nn.Module):
    """XGLM's fixed positions: a (max_positions + 2, dim) table of [sin | cos] (a zero column after them where dim is
    odd), the row `padding_idx` zeroed, built in fp32 and held in the model dtype; position p reads row p + 2."""

    def __init__(self, num_positions: int, embedding_dim: int, padding_idx: int | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        rows, half = num_positions + OPT_POSITION_OFFSET, embedding_dim // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
        angles = torch.arange(rows, dtype=torch.float32).unsqueeze(1) * freqs.unsqueeze(0)  # (rows, half)
        table = torch.cat([angles.sin(), angles.cos(), torch.zeros(rows, embedding_dim % 2)], dim=1)
        if padding_idx is not None and padding_idx < rows:
            table[padding_idx] = 0.0
        self.register_buffer("table", table.to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        """positions (T,) int64, each < max_position_embeddings -> (T, dim) in the model dtype."""
        return F.embedding(positions + OPT_POSITION_OFFSET, self.table)


class XGLMModel(OPTModel):
    """OPT's pre-norm stack with XGLM's embeddings: the tokens' scaled by sqrt(d_model) where `scale_embedding`, and
    sinusoidal positions."""

    @staticmethod
    def build_embedding(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                        tp_size: int) -> VocabEmbedding:
        """The token embeddings, times sqrt(d_model) (a Python float) where `scale_embedding`."""
        if not config.raw["scale_embedding"]:
            return VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        embedding = ScaledVocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        embedding.normalizer = math.sqrt(config.hidden_size)  # XGLMScaledWordEmbedding's, unrounded
        return embedding

    @staticmethod
    def build_positions(config: LlamaModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The sinusoidal table, its `pad_token_id` row zeroed."""
        pad = config.raw.get("pad_token_id")
        return SinusoidalPositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                           pad if isinstance(pad, int) else None, dtype, device)


class XGLMForCausalLM(OPTForCausalLM):
    """XGLM (module docstring): OPT's layer names under `model.layers`, the final norm `model.layer_norm`."""

    renamed_modules: ClassVar[dict[str, str]] = {"model.layer_norm.": "model.norm.",
                                                 **OPTForCausalLM.renamed_modules}
    # the sinusoidal table, rebuilt from config.json, should a checkpoint hold it
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("model.embed_positions.weights",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_xglm_config)."""
        return parse_xglm_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> XGLMModel:
        """XGLM's stack."""
        return XGLMModel(config, ops, dtype, device, tp_rank, tp_size)
