"""A plain-torch Llama / Qwen2 decoder step with a contiguous KV cache, written to be exported to ONNX.

Unlike flashllm's engine models (flat token batch, paged cache, op table), this decoder takes the
layout an exported graph is called with: a padded (B, T) batch, an attention mask over past + new
tokens, and per-layer past keys/values (B, Hk, past, D) that it returns extended as "present".
It uses only torch operators that every ONNX runtime has, so the graph needs no custom ops.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from flashllm.models.builtin import BUILTIN_MODELS
from flashllm.models.hf_config import ModelLoadError, load_hf_config
from flashllm.models.llama_config import LlamaModelConfig
from flashllm.models.loader import safetensors_files
from flashllm.models.registry import ModelRegistry
from flashllm.ops.rope_cache import rope_inv_freq

# architecture -> (q/k/v projections have a bias, o_proj has a bias); None = read attention_bias
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool] | None] = {
    "LlamaForCausalLM": None,
    "Qwen2ForCausalLM": (True, False),
}
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (so a float16 graph keeps its precision), result in x.dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x (..., hidden) -> (..., hidden)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Neox-style RoPE on the first rotary_dim features; cos/sin are computed from positions in fp32."""

    def __init__(self, config: LlamaModelConfig) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                                   config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor
        self.rotary_dim = config.rotary_dim

    def cos_sin(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids (B, T) int64 -> cos, sin (B, 1, T, rotary_dim / 2) fp32."""
        angles = position_ids.float().unsqueeze(-1) * self.inv_freq  # (B, T, rotary_dim / 2)
        angles = angles.unsqueeze(1)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, H, T, D) -> rotated x, same shape and dtype."""
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, rest), dim=-1)


class Attention(nn.Module):
    """GQA self-attention over past + new keys; returns the output and the extended cache."""

    def __init__(self, config: LlamaModelConfig, qkv_bias: bool, o_bias: bool, window: int | None) -> None:
        super().__init__()
        d, hq, hk = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads, self.window = d, hq, hk, window
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, hk * d, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, hk * d, bias=qkv_bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=o_bias)

    def forward(self, x: Tensor, rotary: Rotary, cos: Tensor, sin: Tensor, allowed: Tensor,
                past_key: Tensor, past_value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, hidden); allowed (B, 1, T, past+T) bool; past (B, Hk, past, D).

        Returns (B, T, hidden) and the present key, value (B, Hk, past+T, D).
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        key, value = torch.cat((past_key, k), dim=2), torch.cat((past_value, v), dim=2)
        group = self.num_heads // self.num_kv_heads
        # (B, Hk, group, T, D) against (B, Hk, 1, S, D): GQA without repeating the cache
        q = q.reshape(b, self.num_kv_heads, group, t, self.head_dim).float()
        scores = q @ key.unsqueeze(2).float().transpose(-1, -2) * self.head_dim**-0.5
        # a finite fill: a left-padding query row with no allowed key gets a harmless uniform row, not NaN
        scores = scores.masked_fill(~allowed.unsqueeze(1), torch.finfo(torch.float32).min)
        out = scores.softmax(dim=-1) @ value.unsqueeze(2).float()  # (B, Hk, group, T, D)
        out = out.to(x.dtype).reshape(b, self.num_heads, t, self.head_dim).transpose(1, 2)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), key, value


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=bias), nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: LlamaModelConfig, qkv_bias: bool, o_bias: bool, window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, o_bias, window)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: LlamaModelConfig, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, qkv_bias, o_bias, config.sliding_windows[i])
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def attention_allowed(position_ids: Tensor, attention_mask: Tensor, window: int | None) -> Tensor:
    """Which keys each new token may attend: (B, 1, T, past+T) bool.

    position_ids (B, T); attention_mask (B, past+T) with 0 on left padding. A key's position is
    the count of unpadded keys before it, so causality and sliding windows follow the positions,
    whatever the padding.
    """
    key_pos = attention_mask.long().cumsum(-1) - 1  # (B, S)
    q_pos = position_ids.unsqueeze(-1)  # (B, T, 1)
    allowed = (key_pos.unsqueeze(1) <= q_pos) & (attention_mask.unsqueeze(1) > 0)
    if window is not None:
        allowed = allowed & (q_pos - key_pos.unsqueeze(1) < window)
    return allowed.unsqueeze(1)


class StaticDecoder(nn.Module):
    """Llama / Qwen2 decoder step over a contiguous cache: the module `flashllm export` traces.

    Parameter names are the checkpoint's (HF) names, so weights load with no mapping.
    """

    def __init__(self, config: LlamaModelConfig) -> None:
        super().__init__()
        biases = SUPPORTED_ARCHITECTURES.get(config.architecture)
        qkv_bias, o_bias = biases if biases is not None else (config.attention_bias, config.attention_bias)
        self.config = config
        self.model = Backbone(config, qkv_bias, o_bias)
        self.rotary = Rotary(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                *past: Tensor) -> tuple[Tensor, ...]:
        """One decoder step.

        input_ids, position_ids (B, T) int64; attention_mask (B, past+T) int64 (0 = padding);
        past: key_0, value_0, key_1, ... each (B, Hk, past, D) in the model dtype.
        Returns (logits (B, T, V) fp32, present key_0, value_0, ... each (B, Hk, past+T, D)).
        """
        if len(past) != 2 * self.num_layers:
            raise ValueError(f"expected {2 * self.num_layers} past tensors (key, value per layer), got {len(past)}")
        cos, sin = self.rotary.cos_sin(position_ids)
        masks: dict[int | None, Tensor] = {}
        hidden = self.model.embed_tokens(input_ids)
        present: list[Tensor] = []
        for i, layer in enumerate(self.model.layers):
            window = layer.self_attn.window
            if window not in masks:
                masks[window] = attention_allowed(position_ids, attention_mask, window)
            attn, key, value = layer.self_attn(layer.input_layernorm(hidden), self.rotary, cos, sin,
                                               masks[window], past[2 * i], past[2 * i + 1])
            hidden = hidden + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            present += [key, value]
        logits = self.lm_head(self.model.norm(hidden)).float()
        return (logits, *present)

    def empty_past(self, batch: int, dtype: torch.dtype | None = None, past_len: int = 0) -> list[Tensor]:
        """Zero past keys/values (B, Hk, past_len, D) for every layer, key then value."""
        attn = self.model.layers[0].self_attn
        dtype = dtype or self.lm_head.weight.dtype
        shape = (batch, attn.num_kv_heads, past_len, attn.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * self.num_layers)]


def load_static_decoder(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> StaticDecoder:
    """Build a StaticDecoder from a Llama / Qwen2 model directory's config.json and safetensors.

    Reads safetensors only (through flashllm's checked file list); raises ModelLoadError (one line)
    for another architecture, a GPTQ/AWQ checkpoint, or missing / unexpected / mis-shaped tensors.
    Returns the decoder in eval mode, in `dtype`, on CPU.
    """
    registry = ModelRegistry.from_targets({arch: BUILTIN_MODELS[arch] for arch in SUPPORTED_ARCHITECTURES})
    config = load_hf_config(model_dir, registry)
    if config.quantization is not None:
        raise ModelLoadError(f"{model_dir} is a {config.quantization.method} checkpoint; static export "
                             "needs float weights (export the unquantized model)")
    with torch.device("meta"):
        decoder = StaticDecoder(config)
    decoder = decoder.to_empty(device="cpu")
    decoder.rotary = Rotary(config)  # its buffer was built on the meta device
    if config.tie_word_embeddings:  # to_empty gives each module fresh storage: tie again
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    _load_weights(decoder, _tensors(safetensors_files(model_dir)))
    return decoder.to(dtype).eval()


def _tensors(files: dict[Path, set[str] | None]) -> Iterable[tuple[str, Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _load_weights(decoder: StaticDecoder, tensors: Iterable[tuple[str, Tensor]]) -> None:
    params = dict(decoder.named_parameters())
    tied = decoder.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name.endswith(SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if param.shape != tensor.shape:
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)} from config.json")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        raise ModelLoadError(f"checkpoint does not match config.json: missing {missing[:3]} "
                             f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})")
