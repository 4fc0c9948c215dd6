"""Phi (`PhiForCausalLM`: microsoft/phi-1, phi-1_5, phi-2): a parallel block, x + attn(ln(x)) + mlp(ln(x)), with one
biased LayerNorm per layer (`layer_norm_eps`), Llama's attention with biases on q / k / v and on the output projection
(`self_attn.dense`), RoPE (NEOX halves) over the first `partial_rotary_factor` (default 0.5) of each head, optional
per-head q / k LayerNorms before RoPE (`qk_layernorm`, one (head_dim,) norm shared by every head), the ungated MLP
`fc2(gelu_new(fc1(x)))` with biases, a final LayerNorm (`model.final_layernorm`) and an LM head with a bias, as
transformers' PhiConfig / PhiForCausalLM read them. Dropouts (`resid_pdrop`, `embd_pdrop`, `attention_dropout`) are
training-only. The block and the head's bias are not Llama's, so the model takes the per-op path."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.hf_config import ModelLoadError, flag
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.block import ParallelBlock
from flashllm.models.layers.embedding import LMHead, VocabEmbedding
from flashllm.models.layers.linear import copy_checked
from flashllm.models.layers.mlp import PLAIN_ACTIVATIONS, PlainMLP
from flashllm.models.layers.norm import LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import HiddenTaps, LlamaAttention, LlamaForCausalLM, LlamaModel, run_decoder_stack
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config

# transformers' PhiConfig defaults (phi-1's shape) where config.json leaves a field out
PHI_DEFAULTS: dict[str, Any] = {
    "vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
    "num_attention_heads": 32, "hidden_act": "gelu_new", "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
    "tie_word_embeddings": False, "qk_layernorm": False, "bos_token_id": 1, "eos_token_id": 2,
}
PHI_ROTARY = 0.5  # PhiConfig's partial_rotary_factor default


def parse_phi_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: `layer_norm_eps` as the norms' eps, biases on every projection, RoPE over
    `partial_rotary_factor` (default 0.5) of each head, an ungated activation (PLAIN_ACTIVATIONS), full attention;
    `qk_layernorm` stays in `raw`. A pre-quantized checkpoint is refused (quantize at load with --quant_type). Raises
    ModelLoadError (one line)."""
    if raw.get("quantization_config") is not None:
        raise ModelLoadError(f"{source}: Phi loads float checkpoints only (quantize them at load with --quant_type); "
                             "drop quantization_config or use a float checkpoint")
    fields = {**PHI_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    qk_layernorm = flag(fields, "qk_layernorm", source)
    # transformers' Phi attends to every earlier position whatever a sliding_window field says
    fields |= {"rms_norm_eps": fields["layer_norm_eps"], "attention_bias": True, "mlp_bias": True,
               "sliding_window": None}
    config = parse_llama_config(fields, source, rotary_default=PHI_ROTARY, activations=tuple(PLAIN_ACTIVATIONS))
    whole = config.hidden_size // config.num_attention_heads
    if qk_layernorm and config.head_dim != whole:
        # transformers sizes the q / k LayerNorms hidden_size / heads whatever head_dim says
        raise ModelLoadError(f"{source}: qk_layernorm with head_dim={config.head_dim} other than hidden_size / "
                             f"num_attention_heads = {whole}; transformers' Phi cannot run it either")
    return config


class PhiAttention(LlamaAttention):
    """LlamaAttention (qkv_proj -> [q / k norms] -> partial RoPE -> paged attention -> o_proj) whose optional q / k
    norms are LayerNorms with a bias over head_dim (`qk_layernorm`), not RMSNorms. Biases on q / k / v and o where
    config.attention_bias (always for Phi; never for GPT-J, which shares the block)."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        bias = config.attention_bias
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, bias, bias, tp_rank, tp_size)
        if config.raw.get("qk_layernorm"):
            self.q_norm = LayerNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)
            self.k_norm = LayerNorm(self.head_dim, config.rms_norm_eps, ops, dtype, device)


class PhiDecoderLayer(ParallelBlock):
    """The parallel block: one LayerNorm feeds both the attention and the MLP, whose outputs add to the stream as
    transformers adds them, (attn + mlp) + x (ParallelBlock.branches_first)."""

    branches_first = True

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = PhiAttention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size)
        self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, True, config.hidden_act, ops, dtype, device,
                            tp_rank, tp_size)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)


class PhiModel(nn.Module):
    """Embedding, Phi layers and the final LayerNorm (HF's `model.` prefix; `final_layernorm` loads as `norm`)."""

    hidden_taps: HiddenTaps | None = None  # run_decoder_stack keeps tapped layers' inputs here

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp_rank, tp_size)
        self.rotary_emb = LlamaModel.build_rotary(config, ops, device)
        self.layers = nn.ModuleList(
            PhiDecoderLayer(config, i, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)
            for i in range(config.num_hidden_layers)
        )
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn_metadata: AttentionMetadata) -> Tensor:
        """input_ids (T,), positions (T,) -> final hidden states (T, hidden)."""
        return run_decoder_stack(self, input_ids, positions, kv_caches, attn_metadata)


class BiasedLMHead(LMHead):
    """LMHead adding a (vocab,) bias inside the matmul (as nn.Linear with a bias does); rank r holds the bias of
    its vocabulary rows, zeros past the real vocabulary, like the weight. A tied head shares only the weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, ops, dtype, device, tp_rank, tp_size)
        self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=dtype, device=device),
                                 requires_grad=False)
        self.bias.weight_loader = self.bias_loader

    def bias_loader(self, param: Tensor, loaded_bias: Tensor, shard_id: Any = None) -> None:
        """Copy this rank's entries of the (vocab,) checkpoint bias."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        if tuple(loaded_bias.shape) != (self.num_embeddings,):
            raise ValueError(f"LM head bias has shape {tuple(loaded_bias.shape)} but the model expects "
                             f"{(self.num_embeddings,)}; the checkpoint does not match its config.json")
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.narrow(0, 0, rows), loaded_bias.narrow(0, self.vocab_start, rows), "bias")

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (N, hidden) -> logits (N, V) in hidden.dtype, the bias added."""
        if self.qweight is None:
            raise RuntimeError("LMHead used before process_weights_after_loading(); load the model "
                               "with flashllm.models.loader.load_model")
        logits = self._quant_matmul(hidden, self.qweight, self.bias)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]


class PhiForCausalLM(LlamaForCausalLM):
    """Phi (module docstring): q / k / v fused at load; `self_attn.dense`, `mlp.fc1` / `mlp.fc2`,
    `self_attn.q_layernorm` / `k_layernorm` and `model.final_layernorm` loaded as Llama's o_proj, the plain MLP's
    up / down projections, q_norm / k_norm and model.norm; `lm_head.bias` into the biased head."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    renamed_modules: ClassVar[dict[str, str]] = {
        ".self_attn.dense.": ".self_attn.o_proj.", ".mlp.fc1.": ".mlp.up_proj.", ".mlp.fc2.": ".mlp.down_proj.",
        ".self_attn.q_layernorm.": ".self_attn.q_norm.", ".self_attn.k_layernorm.": ".self_attn.k_norm.",
        "model.final_layernorm.": "model.norm.",
    }
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    required_ops: ClassVar[tuple[str, ...]] = ("layer_norm",)

    def __init__(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops, dtype, device, tp_rank, tp_size)
        del self.lm_head  # Llama's head has no bias: freed before the biased one is allocated
        self.lm_head = BiasedLMHead(config.vocab_size, config.hidden_size, ops, dtype, device, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_phi_config)."""
        return parse_phi_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> PhiModel:
        """Phi's parallel-block stack (its projections always carry biases)."""
        return PhiModel(config, ops, dtype, device, tp_rank, tp_size)

    def fusions(self) -> dict[str, Any]:
        """None: the fused LM head has no bias and the fused decoder stack runs sequential pre-norm blocks."""
        return {}
