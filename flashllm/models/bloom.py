"""BLOOM (`BloomForCausalLM`: BigScience's BLOOM 560m..176B and the BLOOMZ / mT0-style fine-tunes of it), as
transformers' BloomConfig / BloomForCausalLM read and run it: the word embeddings followed by a biased LayerNorm
(`word_embeddings_layernorm`); pre-norm layers of biased LayerNorms (`layer_norm_epsilon`), one fused
`self_attention.query_key_value` projection whose output rows go head by head, each head's q, k and v rows side by
side, with a bias, an output projection `self_attention.dense` with a bias, and the ungated MLP
`dense_4h_to_h(gelu_tanh(dense_h_to_4h(x)))` (4 x hidden wide) with biases; a final LayerNorm `ln_f` and an LM head
tied to the embeddings (unless `tie_word_embeddings` is false).

There is no rotary or learned position embedding: every head adds ALiBi biases, slope[h] x key position, with the
slopes of flashllm.ops.alibi_slopes (transformers' _get_alibi_slopes, non-power-of-two head counts included).
transformers adds slope x the key's absolute position; paged_attention adds slope x (key - query) position, which
differs by slope x the query's position, one constant per score row, which softmax ignores. There is no grouped-query
attention. Dropouts are training-only, and `pretraining_tp` / `slow_but_exact` only change how transformers sums the
same products. config.json names its sizes either way (`n_embed` / `hidden_size`, `n_layer` / `num_hidden_layers`,
`n_head` / `num_attention_heads`), read with transformers' precedence."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.baichuan import BaichuanAlibiAttention, check_alibi_kernel
from flashllm.models.errors import ModelLoadError
from flashllm.models.gpt_neox import split_fused_qkv
from flashllm.models.hf_config import flag
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import VocabEmbedding
from flashllm.models.layers.mlp import PlainMLP
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.llama import HiddenTaps, LlamaForCausalLM, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' BloomConfig defaults where config.json leaves a field out
BLOOM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 250880, "hidden_size": 64, "n_layer": 2, "n_head": 8, "layer_norm_epsilon": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
}
# BloomConfig has no context length (ALiBi has no table to outgrow); BLOOM was trained on 2048-token sequences
BLOOM_CONTEXT = 2048
BLOOM_ACTIVATION = "gelu_pytorch_tanh"  # bloom_gelu: the tanh approximation of GELU
_CHECKPOINT_FIELDS = ("architectures", "model_type", "vocab_size", "bos_token_id", "eos_token_id",
                      "tie_word_embeddings", "dtype", "torch_dtype")


@dataclass(frozen=True, slots=True)
class BloomModelConfig(LlamaModelConfig):
    """LlamaModelConfig of a BLOOM config.json: rms_norm_eps holds layer_norm_epsilon, intermediate_size is 4 x
    hidden_size, max_position_embeddings BLOOM_CONTEXT; every layer adds ALiBi biases."""

    @property
    def alibi(self) -> bool:
        """The attention adds ALiBi biases (read by the engine to resolve attention kernels that implement them)."""
        return True


def parse_bloom_config(raw: dict[str, Any], source: str = "config.json") -> BloomModelConfig:
    """config.json -> BloomModelConfig: hidden size, layers and heads under either name (transformers' names win, and
    `n_embed` over `hidden_size`), biases everywhere, the tanh GELU, full attention. A pre-quantized checkpoint and
    `apply_residual_connection_post_layernorm` (residuals taken after the norms; no published BLOOM sets it) are
    refused. Raises ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: BLOOM loads float checkpoints only (quantize them at load with "
                             "--quant_type); drop quantization_config or use a float checkpoint")
    given = {**BLOOM_DEFAULTS, **raw}
    if flag(given, "apply_residual_connection_post_layernorm", source):
        raise ModelLoadError(f"{source}: apply_residual_connection_post_layernorm=true (residuals after the norms) is "
                             "not supported; flashllm runs BLOOM's pre-norm residual, expected false")
    hidden = given["hidden_size"] if given.get("n_embed") is None else given["n_embed"]
    view = {key: given[key] for key in _CHECKPOINT_FIELDS if key in given}
    view |= {"hidden_size": hidden, "intermediate_size": 4 * hidden if isinstance(hidden, int) else hidden,
             "num_hidden_layers": given.get("num_hidden_layers", given["n_layer"]),
             "num_attention_heads": given.get("num_attention_heads", given["n_head"]),
             "max_position_embeddings": BLOOM_CONTEXT, "rms_norm_eps": given["layer_norm_epsilon"],
             "attention_bias": True, "mlp_bias": True, "hidden_act": BLOOM_ACTIVATION}
    llama = parse_llama_config(view, source, activations=(BLOOM_ACTIVATION,))
    values = {f.name: getattr(llama, f.name) for f in fields(LlamaModelConfig)}
    return BloomModelConfig(**values | {"raw": raw})


class BloomEmbedding(VocabEmbedding):
    """word_embeddings, then word_embeddings_layernorm (held as `norm`): ids (T,) -> (T, hidden). The LM head ties
    to the table itself, before the norm."""

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (T,) int64 -> normed embeddings (T, hidden)."""
        return self.norm(super().forward(input_ids))


class BloomBlock(PreNormBlock):
    """x + attn(layernorm(x)), then + mlp(layernorm(.)); the residual add fused in the norms."""

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = BaichuanAlibiAttention(config, ops, dtype, device, tp_rank, tp_size, bias=True)
        self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, True, config.hidden_act, ops, dtype, device,
                            tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)


class BloomModel(nn.Module):
    """The normed embedding, BLOOM blocks and `ln_f`, under flashllm's `model.` names; a subclass (MPT's) sets its
    own `block_class` (built as (config, ops, dtype, device, tp_rank, tp_size)), `norm_bias` and build_embedding."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here
    block_class: ClassVar[type[nn.Module]] = BloomBlock
    norm_bias: ClassVar[bool] = True  # the final LayerNorm's

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = self.build_embedding(config, ops, dtype, device, tp_rank, tp_size)
        self.layers = nn.ModuleList(self.block_class(config, ops, dtype, device, tp_rank, tp_size)
                                    for _ in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device, bias=self.norm_bias)

    @staticmethod
    def build_embedding(config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
                        tp_size: int) -> VocabEmbedding:
        """The token embedding: BLOOM's is followed by a LayerNorm (BloomEmbedding)."""
        return BloomEmbedding(config, ops, dtype, device, tp_rank, tp_size)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) (unused: ALiBi reads cache positions) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class BloomForCausalLM(LlamaForCausalLM):
    """BLOOM (module docstring). Each layer's fused query_key_value weight and bias are cut into q, k and v rows as
    they load (gpt_neox.split_fused_qkv) and fused again, q then k then v, into qkv_proj, each tensor-parallel rank
    taking its heads' rows (and its heads' ALiBi slopes). Checkpoints saved from BloomModel (bloom-560m's) name their
    tensors without the `transformer.` prefix; both load. A subclass (MPT's) sets its own `stack_class` and
    split_fused."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    renamed_modules: ClassVar[dict[str, str]] = {
        "transformer.word_embeddings_layernorm.": "model.embed_tokens.norm.",
        "transformer.word_embeddings.": "model.embed_tokens.", "transformer.h.": "model.layers.",
        "transformer.ln_f.": "model.norm.", ".self_attention.dense.": ".self_attn.o_proj.",
        ".self_attention.": ".self_attn.", ".mlp.dense_h_to_4h.": ".mlp.up_proj.",
        ".mlp.dense_4h_to_h.": ".mlp.down_proj.",
    }
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ()
    kv_scale_suffixes: ClassVar[tuple[str, ...]] = ()
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    required_ops: ClassVar[tuple[str, ...]] = ("layer_norm",)
    attention_needs: ClassVar[tuple[str, ...]] = ("ALiBi",)
    stack_class: ClassVar[type[BloomModel]] = BloomModel

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> BloomModelConfig:
        """config.json -> BloomModelConfig (parse_bloom_config)."""
        return parse_bloom_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> BloomModel:
        """The ALiBi stack (`stack_class`); refuses an op table whose paged_attention ignores ALiBi slopes."""
        check_alibi_kernel(ops)
        return self.stack_class(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights over the checkpoint's tensors with the fused projection cut (split_fused)."""
        return super().load_weights(self.split_fused(weights))

    def split_fused(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """`transformer.`-prefixed names, each query_key_value cut into q / k / v rows (split_fused_qkv)."""
        return split_fused_qkv(transformer_prefixed(weights), self.config)


def transformer_prefixed(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """A checkpoint saved from the base model (`h.0.` ..., as bloom-560m's) under the causal LM's names
    (`transformer.h.0.` ...), as transformers' base_model_prefix "transformer" reads it (BLOOM's and MPT's)."""
    for name, tensor in weights:
        # `model.` names are a GGUF file's, already flashllm's (flashllm.models.gguf.bloom)
        yield (name if name.startswith(("transformer.", "lm_head.", "model.")) else f"transformer.{name}"), tensor
