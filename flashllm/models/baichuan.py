"""Baichuan / Baichuan2 decoders: Llama's block with q, k, v fused in W_pack; RoPE (7B) or ALiBi (13B);
Baichuan2's LM head with L2-normalized rows. Which applies comes from config.json (see baichuan_config)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashllm.models.baichuan_config import BaichuanModelConfig, parse_baichuan_config
from flashllm.models.base import CausalLM
from flashllm.models.hf_config import ModelLoadError
from flashllm.models.layers.attention import Attention
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import PreNormBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import QKVParallelLinear, RowParallelLinear
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import RMSNorm
from flashllm.models.layers.prequantized import split_output_features
from flashllm.models.llama import LlamaForCausalLM, LlamaModel
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.ops.alibi_slopes import alibi_slopes
from flashllm.registry.fusions import DECODER_STACK

W_PACK = re.compile(r"(.*)\.self_attn\.W_pack\.(weight|qweight|qzeros|scales|g_idx)")  # the last four: GPTQ / AWQ


class BaichuanAlibiAttention(nn.Module):
    """W_pack (held as qkv_proj) -> paged attention with ALiBi biases -> o_proj; no rotary embedding. `bias`: both
    projections have one (BLOOM's query_key_value and dense; Baichuan's have none). `scale`: the score scale (None:
    head_dim ** -0.5; MPT's softmax_scale); `clip_qkv`: q, k and v clamped to [-clip_qkv, clip_qkv] (MPT's)."""

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, bias: bool = False, scale: float | None = None,
                 clip_qkv: float | None = None) -> None:
        super().__init__()
        heads, head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, heads, bias, ops, dtype, device,
                                          tp_rank, tp_size)
        self.num_heads = self.num_kv_heads = self.qkv_proj.num_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias, ops, dtype, device,
                                        tp_rank, tp_size)
        first = tp_rank * self.num_heads  # this rank's query heads, hence its slopes
        slopes = alibi_slopes(heads)[first : first + self.num_heads].to(device)
        scale = head_dim**-0.5 if scale is None else scale
        self.attn = Attention(self.num_heads, head_dim, scale, self.num_kv_heads, ops, alibi_slopes=slopes)
        self.clip_qkv = clip_qkv

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,) (unused: ALiBi biases come from cache positions), hidden (T, hidden) -> (T, hidden)."""
        size = self.num_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in qkv.split(size, dim=-1))
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class BaichuanAlibiDecoderLayer(PreNormBlock):
    """Llama's pre-norm block (residual add fused in the norms) around ALiBi attention."""

    def __init__(self, config: BaichuanModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.self_attn = BaichuanAlibiAttention(config, ops, dtype, device, tp_rank, tp_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)



class BaichuanAlibiModel(nn.Module):
    """Embedding, ALiBi decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: BaichuanModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.layers = nn.ModuleList(BaichuanAlibiDecoderLayer(config, ops, dtype, device, tp_rank, tp_size)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class BaichuanForCausalLM(LlamaForCausalLM):
    """Baichuan-7B / Baichuan-13B / Baichuan2-7B / Baichuan2-13B with the engine's model API.

    The RoPE models are Llama's decoder exactly (a LlamaModel, so backends' fused paths for it
    apply); the ALiBi models run BaichuanAlibiModel and offer no fused decoder stack, whose fused
    decode applies RoPE and no ALiBi bias. W_pack (3 * hidden, hidden), rows [q; k; v], loads as
    the q, k and v shards of qkv_proj (a GPTQ / AWQ W_pack's packed tensors too); Baichuan2's LM
    head rows are normalized once, at load (GPTQ / AWQ checkpoints keep the head in float).
    """

    # Baichuan-7B checkpoints may keep the RoPE inverse frequencies, which are rebuilt from the config
    skipped_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    attention_needs: ClassVar[tuple[str, ...]] = ("ALiBi (13B)",)
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("gptq", "awq")  # W_pack split in packed words
    tokenizer_files: ClassVar[tuple[str, ...] | None] = ("tokenizer.model",)  # sentencepiece

    def __init__(self, config: BaichuanModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        # not LlamaForCausalLM.__init__: that builds a RoPE LlamaModel, and the stack here depends on the config
        CausalLM.__init__(self, config, ops, dtype, device, tp_rank, tp_size)
        self.max_position = config.max_position_embeddings
        self.ops = ops
        if config.alibi:
            check_alibi_kernel(ops)
            self.model = BaichuanAlibiModel(config, ops, dtype, device, tp_rank, tp_size)
        else:
            self.model = LlamaModel(config, ops, dtype, device, False, False, tp_rank, tp_size)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> BaichuanModelConfig:
        """config.json -> BaichuanModelConfig, validated (see flashllm.models.baichuan_config)."""
        return parse_baichuan_config(raw, source)

    @staticmethod
    def attention_biases(config: BaichuanModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): neither, in every Baichuan checkpoint."""
        return False, False

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights with W_pack split into q_proj / k_proj / v_proj, then Baichuan2's head normalized."""
        loaded = super().load_weights(self._split_w_pack(weights))
        if self.config.norm_head and "lm_head.weight" in loaded:
            weight = self.lm_head.weight.data
            # NormHead: logits = hidden @ (W / ||W_row||).T; normalizing in fp32 once equals doing it every step
            weight.copy_(F.normalize(weight.float(), dim=-1).to(weight.dtype))
        return loaded

    def _split_w_pack(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Yield the checkpoint's tensors with each W_pack (3 * hidden, hidden) as its q, k and v rows (unread);
        a GPTQ / AWQ W_pack's packed tensors are cut along their output features the same way."""
        size = self.config.num_attention_heads * self.config.head_dim
        expected = (3 * size, self.config.hidden_size)
        for name, tensor in weights:
            match = W_PACK.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            prefix, suffix = match.groups()
            if suffix == "weight" and tuple(tensor.shape) != expected:
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; expected {expected} "
                                     "(q, k and v rows of the heads config.json describes)")
            parts = split_output_features(name, tensor, (size,) * 3, self.config.quantization)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                yield f"{prefix}.self_attn.{proj}.{suffix}", part

    def fusions(self) -> dict[str, Any]:
        """LlamaForCausalLM's fusions, never DECODER_STACK for ALiBi (its fused decode applies RoPE, no ALiBi)."""
        found = super().fusions()
        if self.config.alibi:
            found.pop(DECODER_STACK, None)
        return found


def check_alibi_kernel(ops: Any) -> None:
    """Refuse an op table whose paged_attention kernel does not implement ALiBi (it would ignore the slopes)."""
    kernel = ops.kernel("paged_attention") if callable(getattr(ops, "kernel", None)) else None
    if kernel is not None and not kernel.caps.alibi:
        raise ValueError(f"this model uses ALiBi, but the op table binds paged_attention to the {kernel.backend} "
                         "kernel, which does not implement it; resolve the op table with OpRequest(alibi=True) "
                         "(flashllm.models.hf_config.uses_alibi(config)) so the reference kernel is bound")
