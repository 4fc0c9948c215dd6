"""OPT (`OPTForCausalLM`: facebook/opt-125m / 350m / 1.3b / 2.7b / 6.7b / 13b / 30b / 66b, OPT-IML and their
fine-tunes), as transformers' OPTConfig / OPTForCausalLM read and run it: learned absolute positions `embed_positions`
looked up at position + 2 (the table has max_position_embeddings + 2 rows), added to the token embeddings (no RoPE);
multi-head attention with separate q / k / v projections and `out_proj`, biased where `enable_bias` (the default),
scores scaled by head_dim ** -0.5; the ungated MLP `fc2(act(fc1(x)))` (`ffn_dim` features, ReLU by default), biased
where `enable_bias`; LayerNorms with eps 1e-5 (nn.LayerNorm's: config.json has no eps), without scale or shift where
`layer_norm_elementwise_affine` is false; an LM head tied to the token embeddings unless config.json says otherwise.

`do_layer_norm_before` (the default; every size but 350m) runs the pre-norm block x + attn(ln(x)), then + mlp(ln(.)),
and a final LayerNorm (left out where `_remove_final_layer_norm`); opt-350m's false runs the post-norm block,
h = ln(x + attn(x)), out = ln(h + mlp(h)), with no final norm. A `word_embed_proj_dim` other than hidden_size
(opt-350m's 512) gives embeddings and LM head that width, with the unbiased `project_in` (to hidden) after the token
lookup, before the positions are added, and `project_out` (back) after the last layer; both are small and held whole
on every tensor-parallel rank. Checkpoints are read with or without the `model.` prefix (the original facebook files
name `decoder.*`). Dropouts and layerdrop are training-only. The stack is not Llama's, so the model takes the per-op
path (the plain LM head's fused path stays offered)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.gpt_bigcode import UNREAD_LLAMA_FIELDS
from flashllm.models.hf_config import MAX_HIDDEN_SIZE, flag, positive_int
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.embedding import LMHead, PositionEmbedding, VocabEmbedding
from flashllm.models.layers.linear import ReplicatedLinear
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.llama import HiddenTaps, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.smollm3 import NoPositionEmbedding
from flashllm.models.starcoder2 import Starcoder2DecoderLayer, Starcoder2ForCausalLM

# transformers' OPTConfig defaults where config.json leaves a field out (opt-125m's shape)
OPT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072, "max_position_embeddings": 2048,
    "do_layer_norm_before": True, "_remove_final_layer_norm": False, "num_attention_heads": 12,
    "activation_function": "relu", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "enable_bias": True,
    "layer_norm_elementwise_affine": True, "tie_word_embeddings": True,
}
OPT_POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding's: position p reads row p + 2
OPT_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which OPT's norms keep
_FLAGS = ("do_layer_norm_before", "_remove_final_layer_norm", "enable_bias", "layer_norm_elementwise_affine")


def parse_opt_config(raw: dict[str, Any], source: str = "config.json", defaults: dict[str, Any] = OPT_DEFAULTS,
                     family: str = "OPT") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: `ffn_dim` as the MLP's width, `activation_function` as hidden_act (an ungated
    one, PLAIN_ACTIVATIONS), `enable_bias` as the attention's and the MLP's biases, as many key / value heads as query
    heads, no rope or window. The OPT fields (_FLAGS, `word_embed_proj_dim`, hidden_size where null) stay in `raw`,
    validated and completed by OPTConfig's defaults. A pre-quantized checkpoint is refused (quantize at load with
    --quant_type). `defaults` and `family` (the refusals' name) are another family's where it reads its config.json
    into OPT's fields (XGLM). Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: {family} loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    fields = {**defaults, **{key: value for key, value in raw.items() if value is not None}}
    for key in _FLAGS:
        fields[key] = flag(fields, key, source)
    hidden = fields["hidden_size"]
    fields["word_embed_proj_dim"] = positive_int(fields, "word_embed_proj_dim", hidden if isinstance(hidden, int)
                                                 else None, MAX_HIDDEN_SIZE, source)
    view = {key: value for key, value in fields.items() if key not in UNREAD_LLAMA_FIELDS}
    bias = fields["enable_bias"]
    view |= {"intermediate_size": fields["ffn_dim"], "hidden_act": fields["activation_function"],
             "rms_norm_eps": OPT_LAYER_NORM_EPS, "attention_bias": bias, "mlp_bias": bias}
    return parse_llama_config(view, source, activations=tuple(PLAIN_ACTIVATIONS))


class OPTPositionEmbedding(PositionEmbedding):
    """OPT's learned positions: max_positions + 2 rows, position p reading row p + 2."""

    def __init__(self, num_positions: int, embedding_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_positions + OPT_POSITION_OFFSET, embedding_dim, dtype, device)

    def forward(self, positions: Tensor) -> Tensor:
        """positions (T,) int64, each < max_position_embeddings -> (T, hidden)."""
        return super().forward(positions + OPT_POSITION_OFFSET)


class ProjectedEmbedding(VocabEmbedding):
    """Token embeddings of word_embed_proj_dim features (split over the vocabulary as VocabEmbedding's), then the
    whole unbiased `project_in` to hidden_size (opt-350m's 512 -> 1024)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, hidden_size: int, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, device, tp_rank, tp_size)
        self.project_in = ReplicatedLinear(embedding_dim, hidden_size, False, ops, dtype, device, tp_rank, tp_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (T,) int64 -> (T, hidden_size)."""
        return self.project_in(super().forward(input_ids))


class ResidualAdd(nn.Module):
    """The stack's final `norm` where OPT has none (post-norm blocks, `_remove_final_layer_norm`): the stream as it
    is, x + residual where the layers left it split."""

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, None]:
        """x (T, H), residual (T, H) or None -> (x + residual, None)."""
        return (x if residual is None else x + residual), None


class OPTPostNormLayer(Starcoder2DecoderLayer):
    """do_layer_norm_before=false (opt-350m): h = input_layernorm(x + attn(x)), out = post_attention_layernorm(h +
    mlp(h)), each add fused into its norm. Its output is normed whole, so as run_decoder_stack's layer it returns
    (out, None) and takes the stream whole (residual None)."""

    def forward(self, positions: Tensor, hidden: Tensor, residual: Tensor | None, kv_cache: tuple[Tensor, ...],
                attn_metadata: AttentionMetadata) -> tuple[Tensor, None]:
        """hidden (T, H), residual None -> (the layer's output (T, H), None)."""
        attended = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, _ = self.input_layernorm(attended, hidden)
        out, _ = self.post_attention_layernorm(self.mlp(hidden), hidden)
        return out, None


class OPTModel(nn.Module):
    """Token embeddings (projected in where word_embed_proj_dim differs), positions at offset 2, OPT's pre- or
    post-norm layers without RoPE, the final LayerNorm (or none), `project_out`; flashllm's `model.` names. A
    subclass builds its own embeddings (build_embedding, build_positions: XGLM's scaled ones and sinusoids)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        hidden, width = config.hidden_size, config.raw["word_embed_proj_dim"]
        self.embed_tokens = self.build_embedding(config, ops, dtype, device, tp_rank, tp_size)
        self.embed_positions = self.build_positions(config, dtype, device)
        self.layers = nn.ModuleList(self.build_layer(config, i, ops, dtype, device, tp_rank, tp_size)
                                    for i in range(config.num_hidden_layers))
        if config.raw["do_layer_norm_before"] and not config.raw["_remove_final_layer_norm"]:
            self.norm = self.layer_norm(config)(hidden, config.rms_norm_eps, ops, dtype, device)
        else:
            self.norm = ResidualAdd()
        self.project_out = None
        if width != hidden:
            self.project_out = ReplicatedLinear(hidden, width, False, ops, dtype, device, tp_rank, tp_size)

    @staticmethod
    def build_embedding(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                        tp_size: int) -> VocabEmbedding:
        """The token embeddings: word_embed_proj_dim wide, projected in to hidden_size where that differs."""
        hidden, width = config.hidden_size, config.raw["word_embed_proj_dim"]
        if width == hidden:
            return VocabEmbedding(config.vocab_size, hidden, dtype, device, tp_rank, tp_size)
        return ProjectedEmbedding(config.vocab_size, width, hidden, ops, dtype, device, tp_rank, tp_size)

    @staticmethod
    def build_positions(config: LlamaModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The learned position table, read at offset 2."""
        return OPTPositionEmbedding(config.max_position_embeddings, config.hidden_size, dtype, device)

    @staticmethod
    def layer_norm(config: LlamaModelConfig) -> partial[LayerNorm]:
        """OPT's LayerNorm class: with scale and shift unless `layer_norm_elementwise_affine` is false."""
        affine = config.raw["layer_norm_elementwise_affine"]
        return partial(LayerNorm, bias=affine, weight=affine)

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """StarCoder 2's pre-norm block (do_layer_norm_before) or OPTPostNormLayer, unrotated, over OPT's norms."""
        block = Starcoder2DecoderLayer if config.raw["do_layer_norm_before"] else OPTPostNormLayer
        return block(config, layer_idx, NoPositionEmbedding(), ops, dtype, device, tp_rank, tp_size,
                     self.layer_norm(config))

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, word_embed_proj_dim)."""
        hidden = run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTForCausalLM(Starcoder2ForCausalLM):
    """OPT (module docstring): `decoder.` names taken under `model.`, then `model.decoder.embed_tokens` /
    `embed_positions` / `final_layer_norm` / `project_in` / `project_out`, `self_attn_layer_norm` /
    `final_layer_norm`, `self_attn.out_proj`, `fc1` / `fc2` loaded as the embeddings, the final norm, the
    projections, each layer's two norms, o_proj and the plain MLP's up / down projections; q / k / v fused into
    qkv_proj, each tensor-parallel rank taking its heads' rows."""

    renamed_modules: ClassVar[dict[str, str]] = {
        "model.decoder.final_layer_norm.": "model.norm.", "model.decoder.project_in.": "model.embed_tokens.project_in.",
        "model.decoder.": "model.", ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".self_attn_layer_norm.": ".input_layernorm.", ".final_layer_norm.": ".post_attention_layernorm.",
        ".fc1.": ".mlp.up_proj.", ".fc2.": ".mlp.down_proj.",
    }
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        width = config.raw["word_embed_proj_dim"]
        if width != config.hidden_size:  # the head reads project_out's features
            self.lm_head = LMHead(config.vocab_size, width, ops, dtype, device, tp_rank, tp_size)
            if config.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_opt_config)."""
        return parse_opt_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> OPTModel:
        """OPT's stack."""
        return OPTModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights over opt_tensors."""
        return super().load_weights(opt_tensors(weights))


def opt_tensors(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """OPT checkpoint tensors with `model.` put before the original files' `decoder.` names (OPTModel's, which
    transformers loads under its base_model_prefix)."""
    for name, tensor in weights:
        yield (f"model.{name}" if name.startswith("decoder.") else name), tensor
