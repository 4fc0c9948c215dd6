"""StableLM (`StableLmForCausalLM`: stabilityai/stablelm-2-1_6b / -zephyr, stablelm-3b-4e1t, stablecode-3b, stablelm-2-12b):
Llama's attention and gated SiLU MLP in blocks of LayerNorms with biases (`layer_norm_eps`), RoPE (NEOX halves) over
the first `partial_rotary_factor` (default 0.25) of each head, q / k / v biases where `use_qkv_bias` says (never on the
output projection), as transformers' StableLmConfig / StableLmForCausalLM read them.

StableLM 2 12B adds two options: `use_parallel_residual`, one norm feeding attention and MLP side by side
(x + attn(ln(x)) + mlp(ln(x)), no post-attention norm), and `qk_layernorm`, each query and key head LayerNormed over
head_dim with its own scale before RoPE; the checkpoint stores those scales as one small LayerNorm per head
(`self_attn.q_layernorm.norms.H.weight`), stacked here into the (heads, head_dim) rows HeadLayerNorm holds. The stack
is not Llama's, so the model takes the per-op path."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import flag
from flashllm.models.layers.block import ParallelBlock, PreNormBlock
from flashllm.models.layers.mlp import GatedMLP
from flashllm.models.layers.norm import HeadLayerNorm, LayerNorm
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention, LlamaForCausalLM
from flashllm.models.llama_config import LlamaModelConfig, parse_llama_config
from flashllm.models.olmo2 import refuse_prequantized
from flashllm.models.starcoder2 import Starcoder2Model

# transformers' StableLmConfig defaults where config.json leaves a field out (Llama's differ)
STABLELM_DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "max_position_embeddings": 4096, "bos_token_id": 0,
                                     "eos_token_id": 0}
STABLELM_ROTARY = 0.25  # StableLmConfig's partial_rotary_factor default
# one checkpoint tensor per head: model.layers.L.self_attn.{q,k}_layernorm.norms.H.weight
_HEAD_NORM = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qk])_layernorm\.norms\.(\d+)\.weight$")


def parse_stablelm_config(raw: dict[str, Any], source: str = "config.json") -> LlamaModelConfig:
    """config.json -> LlamaModelConfig: `layer_norm_eps` as the norms' eps, `use_qkv_bias` as the q / k / v bias, RoPE
    over `partial_rotary_factor` (default 0.25) of each head, no sliding window (StableLM has none);
    `use_parallel_residual` and `qk_layernorm` stay in `raw`, validated. A pre-quantized checkpoint is refused
    (quantize at load with --quant_type). Raises ModelLoadError (one line)."""
    refuse_prequantized(raw, source)
    fields = {**STABLELM_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    flag(fields, "use_parallel_residual", source)
    flag(fields, "qk_layernorm", source)
    fields |= {"rms_norm_eps": fields["layer_norm_eps"], "attention_bias": flag(fields, "use_qkv_bias", source),
               "mlp_bias": False, "sliding_window": None}
    config = parse_llama_config(fields, source, rotary_default=STABLELM_ROTARY)
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        raise ModelLoadError(f"{source}: head_dim={config.head_dim} x num_attention_heads={config.num_attention_heads} "
                             f"is not hidden_size={config.hidden_size}; StableLM's output projection takes hidden_size")
    return config


class StableLmAttention(LlamaAttention):
    """LlamaAttention with q / k / v biases where `use_qkv_bias`, none on o_proj, and per-head q / k LayerNorms before
    RoPE where `qk_layernorm`."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, config.attention_bias, False,
                         tp_rank, tp_size)
        if config.raw.get("qk_layernorm"):
            eps = config.rms_norm_eps
            self.q_norm = HeadLayerNorm(self.qkv_proj, "q", eps, ops, dtype, device)
            self.k_norm = HeadLayerNorm(self.qkv_proj, "k", eps, ops, dtype, device)


def _modules(config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any, dtype: torch.dtype,
             device: torch.device, tp_rank: int, tp_size: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(attention, gated MLP, input LayerNorm) of one StableLM layer."""
    return (StableLmAttention(config, layer_idx, rotary_emb, ops, dtype, device, tp_rank, tp_size),
            GatedMLP(config.hidden_size, config.intermediate_size, False, ops, dtype, device, tp_rank, tp_size),
            LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device))


class StableLmDecoderLayer(PreNormBlock):
    """x + attn(layernorm(x)), then + mlp(layernorm(.))."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = _modules(config, layer_idx, rotary_emb, ops, dtype, device,
                                                                  tp_rank, tp_size)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)


class StableLmParallelLayer(ParallelBlock):
    """`use_parallel_residual`: (x + attn(ln(x))) + mlp(ln(x)), transformers' order of the sums."""

    def __init__(self, config: LlamaModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = _modules(config, layer_idx, rotary_emb, ops, dtype, device,
                                                                  tp_rank, tp_size)


class StableLmModel(Starcoder2Model):
    """Embedding, StableLM layers (sequential or parallel, as config.json says) and the final LayerNorm."""

    def build_layer(self, config: LlamaModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype,
                    device: torch.device, tp_rank: int, tp_size: int) -> nn.Module:
        """A parallel layer where `use_parallel_residual`, else a sequential one."""
        layer = StableLmParallelLayer if config.raw.get("use_parallel_residual") else StableLmDecoderLayer
        return layer(config, layer_idx, self.rotary_emb, ops, dtype, device, tp_rank, tp_size)


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM (module docstring): Llama's checkpoint names (q / k / v and gate / up fused at load), LayerNorm biases,
    and the per-head q / k norm tensors stacked per layer at load."""

    prequantized_methods: ClassVar[tuple[str, ...] | None] = ()
    required_ops: ClassVar[tuple[str, ...]] = ("layer_norm",)

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> LlamaModelConfig:
        """config.json -> LlamaModelConfig (parse_stablelm_config)."""
        return parse_stablelm_config(raw, source)

    def build_stack(self, config: LlamaModelConfig, ops: Any, dtype: torch.dtype, device: torch.device,
                    qkv_bias: bool, o_bias: bool, tp_rank: int, tp_size: int) -> StableLmModel:
        """StableLM's LayerNorm stack."""
        return StableLmModel(config, ops, dtype, device, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """CausalLM.load_weights, with each layer's per-head q / k norm tensors stacked into one (heads, head_dim)
        `self_attn.q_norm.weight` / `k_norm.weight` once every head's has arrived."""
        return super().load_weights(_stacked_head_norms(weights, self.config))


def _stacked_head_norms(weights: Iterable[tuple[str, Tensor]], config: LlamaModelConfig) -> Iterator[tuple[str, Tensor]]:
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    pending: dict[tuple[str, str], dict[int, Tensor]] = {}
    for name, tensor in weights:
        match = _HEAD_NORM.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind, head = match[1], match[2], int(match[3])
        if head >= heads[kind]:
            raise ModelLoadError(f"checkpoint tensor {name}: head {head} past the config's {heads[kind]} {kind} heads")
        rows = pending.setdefault((prefix, kind), {})
        rows[head] = tensor
        if len(rows) == heads[kind]:
            del pending[prefix, kind]
            yield f"{prefix}.{kind}_norm.weight", torch.stack([rows[h] for h in range(heads[kind])])
    if pending:
        (prefix, kind), rows = next(iter(pending.items()))
        raise ModelLoadError(f"the checkpoint holds {len(rows)} of the {heads[kind]} per-head {kind}_layernorm tensors "
                             f"of {prefix}; it does not match its config.json")
