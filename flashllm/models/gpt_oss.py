"""gpt-oss decoder (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): Mixtral's pre-norm MoE stack with biased
attention projections, a learned sink logit per head, sliding-window layers alternating with full ones, YaRN
RoPE, a biased router and biased experts with a clamped SwiGLU. MXFP4 expert checkpoints (the published ones)
are dequantized at load."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.hf_config import ModelLoadError, positive_float
from flashllm.models.layers.attention import split_heads
from flashllm.models.layers.attention_metadata import AttentionMetadata
from flashllm.models.layers.linear import copy_checked
from flashllm.models.layers.moe import FusedMoE, SparseMoeBlock
from flashllm.models.layers.rotary import RotaryEmbedding
from flashllm.models.llama import LlamaAttention
from flashllm.models.llama_config import parse_llama_config
from flashllm.models.mixtral import MixtralForCausalLM, MoEModelConfig, every_layer_sparse
from flashllm.ops.fused_moe import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, expert_activation
from flashllm.ops.quant_matmul import QuantizedWeight

# transformers' GptOssConfig defaults (the published models' values)
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": True, "rope_theta": 150000.0,
    "tie_word_embeddings": False,
}
GPT_OSS_ROPE: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}
# MXFP4's e2m1 code points, indexed by a 4-bit code (the high bit is the sign)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DOUBLED_FP4_VALUES = tuple(int(2 * v) for v in FP4_VALUES)  # whole numbers: int8 codes, the scale halved
MXFP4_SCALE_BIAS = 127  # a block's uint8 scale e stands for 2 ** (e - 127)
MXFP4_BLOCK = 32  # values sharing one exponent
_MXFP4 = re.compile(r"^(?P<prefix>.+\.experts\.(?:gate_up_proj|down_proj))_(?P<part>blocks|scales)$")


@dataclass(frozen=True, slots=True)
class GptOssModelConfig(MoEModelConfig):
    """MoEModelConfig plus what the kernel request reads: every attention layer has sinks, the experts the clamped
    "swigluoai" activation and biases; mxfp4_experts: the checkpoint stores the experts as MXFP4 blocks."""

    attention_sinks: bool = True
    moe_activation: str = "swigluoai"
    mxfp4_experts: bool = False


def parse_gpt_oss_config(raw: dict[str, Any], source: str = "config.json") -> GptOssModelConfig:
    """Validate a gpt-oss config.json: Llama's fields with GptOssConfig's defaults (alternating sliding / full
    layers from layer 0, YaRN x32 over 4096 positions), num_local_experts and num_experts_per_tok, every layer MoE
    with intermediate_size features an expert, weights a softmax over the chosen experts. swiglu_alpha /
    swiglu_limit other than 1.702 / 7.0 and pre-quantized formats other than MXFP4 experts are refused (one line).
    """
    fields = {**GPT_OSS_DEFAULTS, **raw}
    layers = fields["num_hidden_layers"]
    if "layer_types" not in raw and isinstance(layers, int) and not isinstance(layers, bool):
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if "rope_scaling" not in raw and "rope_parameters" not in raw:
        fields["rope_scaling"] = GPT_OSS_ROPE
    for key, expected in (("swiglu_alpha", SWIGLUOAI_ALPHA), ("swiglu_limit", SWIGLUOAI_LIMIT)):
        if positive_float(raw, key, expected, source) != expected:
            raise ModelLoadError(f"{source}: {key}={raw[key]!r} is not supported; flashllm's swigluoai experts "
                                 f"implement gpt-oss's {expected}")
    quant = fields.pop("quantization_config", None)
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    if quant is not None and not mxfp4:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelLoadError(f"{source}: quantization_config quant_method={method!r} is not supported for gpt-oss; "
                             "flashllm loads its float and MXFP4-expert checkpoints (use --quant_type to quantize)")
    base = parse_llama_config(fields, source)
    return every_layer_sparse(base, raw, 128, 4, source, GptOssModelConfig, qkv_bias=base.attention_bias,
                              mxfp4_experts=mxfp4)


class GptOssAttention(LlamaAttention):
    """LlamaAttention with `sinks`: (Hq,) learned logits, this rank's heads' share, that join each head's softmax
    (ops.paged_attention's sinks)."""

    def __init__(self, config: MoEModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, ops: Any,
                 dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, layer_idx, rotary_emb, ops, dtype, device, qkv_bias, o_bias, tp_rank, tp_size)
        self.tp_rank = tp_rank
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: Tensor, loaded: Tensor, shard_id: Any = None) -> None:
        """Copy this rank's query heads' sinks from the checkpoint's (num_attention_heads,) tensor, as fp32."""
        if shard_id is not None or loaded.dim() != 1:
            raise ValueError(f"sinks has shape {tuple(loaded.shape)}; expected one logit per attention head")
        copy_checked(param, loaded.narrow(0, self.tp_rank * self.num_heads, self.num_heads), "sinks")

    def forward(self, positions: Tensor, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        """positions (T,), hidden (T, hidden) -> (T, hidden)."""
        q, k, v = split_heads(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata, sinks=self.sinks))


class OaiExperts(FusedMoE):
    """FusedMoE with gpt-oss's expert biases, gate_up_proj_bias (E, 2I/tp) and down_proj_bias (E, H), run with
    the "swigluoai" activation. Checkpoints store gate_up_proj as (E, H, 2I) with gate and up features
    interleaved (even: gate, odd: up) and down_proj as (E, I, H); they are stored here as FusedMoE's (E, 2I, H)
    gate rows then up rows and (E, H, I). Under tensor parallelism rank 0 alone adds the down bias (the ranks'
    partial outputs are summed)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: Any, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, ops, dtype, device, tp_rank, tp_size,
                         expert_parallel)
        inter = self.intermediate_size // self.feature_shards
        self.gate_up_proj_bias = self._param((self.num_local_experts, 2 * inter), dtype, device)
        self.down_proj_bias = self._param((self.num_local_experts, hidden_size), dtype, device)
        self.bias_halves: set[str] = set()  # which halves of gate_up_proj_bias a GGUF file gave ("gate", "up")

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: Any = None) -> None:
        """Load a stacked checkpoint tensor (see the class docstring for the layouts), one expert's projection as
        FusedMoE does (a GGUF file's), or a GGUF file's (E, I) gate or up biases (shard_id "gate" / "up");
        ValueError on another shape."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if shard_id is not None:
            if param is self.gate_up_proj_bias and shard_id in ("gate", "up"):
                self._load_bias_half(loaded, shard_id)
            else:
                super().weight_loader(param, loaded, shard_id)
            return
        if param is self.w13_weight or param is self.w2_weight:
            w13 = param is self.w13_weight
            expected = (e, h, 2 * i) if w13 else (e, i, h)
            if tuple(loaded.shape) != expected:
                raise ValueError(f"experts {'gate_up_proj' if w13 else 'down_proj'} has shape "
                                 f"{tuple(loaded.shape)} but the model expects {expected}")
            stacked = _gate_then_up(loaded.transpose(1, 2), dim=1) if w13 else loaded.transpose(1, 2)
            super().weight_loader(param, stacked, None)
            return
        down = param is self.down_proj_bias
        _check_bias(loaded, (e, h) if down else (e, 2 * i), "down_proj_bias" if down else "gate_up_proj_bias")
        bias = loaded.narrow(0, self.first_expert, self.num_local_experts)  # this rank's experts (all: no EP)
        if down:
            copy_checked(param, bias if self.feature_shards == 1 or self.tp_rank == 0 else torch.zeros_like(bias))
            return
        first, inter = self.rank_features()
        gate, up = _gate_then_up(bias, dim=1).split(i, dim=1)
        copy_checked(param, torch.cat([gate.narrow(1, first, inter), up.narrow(1, first, inter)], dim=1))

    def _load_bias_half(self, loaded: Tensor, half: str) -> None:
        """A GGUF file's gate or up biases (E, I) into this rank's half of gate_up_proj_bias."""
        _check_bias(loaded, (self.num_experts, self.intermediate_size), f"{half} bias")
        first, inter = self.rank_features()
        rows = loaded.narrow(0, self.first_expert, self.num_local_experts).narrow(1, first, inter)
        copy_checked(self.gate_up_proj_bias.narrow(1, 0 if half == "gate" else inter, inter), rows)
        self.bias_halves.add(half)

    def _run(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if self.expert_blocks is not None:
            return super()._run(x, topk_weights, topk_ids)  # per chosen expert, through _block_expert
        return self._fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.w13_scale,
                               self.w2_scale, self.gate_up_proj_bias, self.down_proj_bias, "swigluoai")

    def _block_expert(self, x: Tensor, expert: int) -> Tensor:
        """Local expert `expert` kept as blocks (a GGUF file's, an MXFP4 checkpoint's) over rows x (n, H): its biases and
        activation as fused_moe's."""
        w13, w2 = self.expert_blocks[expert]
        gate_up = self._quant_matmul(x, w13).float() + self.gate_up_proj_bias[expert].float()
        out = self._quant_matmul(expert_activation(gate_up, "swigluoai").to(x.dtype), w2)
        return (out.float() + self.down_proj_bias[expert].float()).to(x.dtype)


def _gate_then_up(interleaved: Tensor, dim: int) -> Tensor:
    """Features interleaved along `dim` (gate, up, gate, up, ...) -> all gates then all ups."""
    pairs = interleaved.unflatten(dim, (-1, 2))  # (..., I, 2, ...)
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def _kernel_quant(ops: Any) -> frozenset[str]:
    """The weight formats the op table's quant_matmul kernel claims ({"none"} for a table without records)."""
    try:
        return ops.kernel("quant_matmul").caps.quant
    except (AttributeError, KeyError):
        return frozenset({"none"})


def _check_bias(loaded: Tensor, expected: tuple[int, int], what: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"experts {what} has shape {tuple(loaded.shape)} but the model expects {expected}")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 weights -> float: blocks (..., G, 16) uint8, two e2m1 codes a byte (low nibble first), scales
    (..., G) uint8 exponents biased by 127, one per block of 32 values -> (..., G * 32) in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
                         f"{tuple(scales.shape)} do not match: expected uint8 (..., G, 16) and (..., G)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # (..., G, 32)
    values = torch.ldexp(lut[codes.long()], scales.to(torch.int32)[..., None] - MXFP4_SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def mxfp4_weight(blocks: Tensor, scales: Tensor) -> QuantizedWeight:
    """One expert projection's MXFP4 blocks (N, G, 16) and exponents (N, G), as stored, as the exact w8a16
    QuantizedWeight (N, G * 32): twice each e2m1 value as an int8 code, 2 ** (e - 128) an fp32 scale per 32."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-3)  # (N, G * 32), element order
    data = torch.tensor(DOUBLED_FP4_VALUES, dtype=torch.int8, device=blocks.device)[codes.long()]
    ones = torch.ones(scales.shape, dtype=torch.float32, device=scales.device)
    return QuantizedWeight("w8a16", data, torch.ldexp(ones, scales.to(torch.int32) - MXFP4_SCALE_BIAS - 1), None,
                           MXFP4_BLOCK)


def mxfp4_as_float(weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype,
                   keep: Callable[[str, Tensor, Tensor], bool] = lambda prefix, blocks, scales: False,
                   ) -> Iterator[tuple[str, Tensor]]:
    """A checkpoint's tensors with each expert projection's MXFP4 `_blocks` / `_scales` pair (stored (E, N, K/32,
    16) / (E, N, K/32)) replaced by the float tensor transformers' gpt-oss holds: (E, K, N); or, where
    keep(prefix, blocks, scales) takes the pair (returns True), by nothing."""
    pending: dict[tuple[str, str], Tensor] = {}
    for name, tensor in weights:
        match = _MXFP4.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, part = match["prefix"], match["part"]
        other = pending.pop((prefix, "scales" if part == "blocks" else "blocks"), None)
        if other is None:
            pending[(prefix, part)] = tensor
            continue
        blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
        blocks, scales = materialize(blocks), materialize(scales)
        if not keep(prefix, blocks, scales):
            yield prefix, dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    if pending:
        missing = sorted(f"{prefix}_{'scales' if part == 'blocks' else 'blocks'}" for prefix, part in pending)
        raise ModelLoadError(f"the checkpoint's MXFP4 experts are incomplete: {', '.join(missing)} not found")


class GptOssForCausalLM(MixtralForCausalLM):
    """gpt-oss: checkpoint names as transformers' (`self_attn.sinks`, `mlp.router`, `mlp.experts.gate_up_proj`,
    `gate_up_proj_bias`, `down_proj`, `down_proj_bias`; or the experts' MXFP4 `_blocks` / `_scales`), q/k/v fused
    at load. The MoE block is Mixtral's with a biased router (softmax over the top-k logits equals the
    renormalized top-k of the softmax) and OaiExperts."""

    attention_needs: ClassVar[tuple[str, ...]] = ("sliding window", "attention sinks")
    prequantized_methods: ClassVar[tuple[str, ...] | None] = ("mxfp4",)  # experts dequantized at load
    renamed_modules: ClassVar[dict[str, str]] = {".mlp.router.": ".mlp.gate."}
    attention_class: ClassVar[type[LlamaAttention]] = GptOssAttention

    @classmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> GptOssModelConfig:
        """config.json -> GptOssModelConfig, validated (see parse_gpt_oss_config)."""
        return parse_gpt_oss_config(raw, source)

    @staticmethod
    def attention_biases(config: MoEModelConfig) -> tuple[bool, bool]:
        """(qkv_proj has a bias, o_proj has a bias): both `attention_bias`, as transformers' gpt-oss."""
        return config.attention_bias, config.attention_bias

    @staticmethod
    def make_mlp(config: MoEModelConfig, layer_idx: int, ops: Any, dtype: torch.dtype, device: torch.device,
                 tp_rank: int, tp_size: int) -> nn.Module:
        """Every layer's MLP: the biased router over OaiExperts, top-k weights renormalized."""
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, True, 0, ops, dtype, device, tp_rank, tp_size,
                              expert_parallel=config.expert_parallel, router_bias=True, experts_class=OaiExperts)

    def _keep_mxfp4(self, prefix: str, blocks: Tensor, scales: Tensor) -> bool:
        """Take an MXFP4 expert projection (`<layer>.mlp.experts.gate_up_proj` or `down_proj`) as blocks when its
        layer holds whole experts (one rank, or expert parallel) and the bound quant_matmul runs w8a16; once a
        layer's two projections arrived, its experts become one (w13, w2) QuantizedWeight pair each
        (FusedMoE.use_expert_blocks), gate rows then up rows (the checkpoint interleaves them)."""
        layer, _, proj = prefix.rpartition(".")
        experts = self.get_submodule(layer)
        if experts.feature_shards > 1 or "w8a16" not in _kernel_quant(self.ops):
            return False
        pending = self._mxfp4_pending.setdefault(layer, {})
        pending[proj] = (blocks, scales)
        if len(pending) < 2:
            return True
        halves = self._mxfp4_pending.pop(layer)
        (up_blocks, up_scales), (down_blocks, down_scales) = halves["gate_up_proj"], halves["down_proj"]
        pairs = []
        for e in experts.local_experts():
            w13 = mxfp4_weight(_gate_then_up(up_blocks[e], dim=0), _gate_then_up(up_scales[e], dim=0))
            pairs.append((w13, mxfp4_weight(down_blocks[e], down_scales[e])))
        experts.use_expert_blocks(pairs)
        return True

    def _param_target(self, name: str) -> tuple[str, Any]:
        """MixtralForCausalLM's, plus a GGUF file's split expert biases: `<...>.experts.gate_proj_bias` and
        `up_proj_bias` are the two halves of gate_up_proj_bias."""
        for half in ("gate", "up"):
            if name.endswith(f".experts.{half}_proj_bias"):
                return name.removesuffix(f"{half}_proj_bias") + "gate_up_proj_bias", half
        return super()._param_target(name)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """MixtralForCausalLM.load_weights over the checkpoint with MXFP4 experts kept as exact int8 blocks where the
        layer can hold them (_keep_mxfp4), else dequantized (mxfp4_as_float); a gate_up_proj_bias given in halves (a
        GGUF file's) counts as loaded once both arrived."""
        self._mxfp4_pending: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}
        loaded = super().load_weights(mxfp4_as_float(weights, self.model.embed_tokens.weight.dtype, self._keep_mxfp4))
        if self._mxfp4_pending:
            layer = next(iter(self._mxfp4_pending))
            raise ModelLoadError(f"{layer} has one MXFP4 expert projection without the other; gpt-oss checkpoints "
                                 "store gate_up_proj and down_proj both as MXFP4 or both as float")
        halves = {f"{name}.gate_up_proj_bias" for name, module in self.named_modules()
                  if isinstance(module, OaiExperts) and module.bias_halves}
        complete = {f"{name}.gate_up_proj_bias" for name, module in self.named_modules()
                    if isinstance(module, OaiExperts) and module.bias_halves == {"gate", "up"}}
        return (loaded - halves) | complete
