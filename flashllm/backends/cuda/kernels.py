"""The cuda backend's kernel table: Triton launchers behind thin wrappers that import triton lazily.

Each wrapper has its op's exact signature (checked at registration) and forwards to the launcher
in its `triton_*` module, imported on the first call: registering costs no triton import, and the
capability matrix is the same whether or not triton is installed where it is rendered.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch
from torch import Tensor

from flashllm.ops.fused_moe import MOE_ACTIVATIONS
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.registry.backend import Backend, Caps

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# Head sizes the attention kernel is proven on (tests/conformance/test_triton_interpret.py); the
# kernel pads D to a power of two >= 16, so others likely work but are not claimed until tested.
ATTENTION_HEAD_SIZES = frozenset({64, 80, 96, 128, 256})
ATTENTION_BLOCK_SIZES = frozenset({16, 32, 64, 128})
QUANT_SCHEMES = frozenset({"none", "w8a16", "w4a16"})

# op -> module under flashllm.backends.cuda holding its launcher (a function named like the op)
KERNEL_MODULES: dict[str, str] = {
    "rms_norm": "triton_norm",
    "layer_norm": "triton_norm",
    "silu_and_mul": "triton_act",
    "gelu_and_mul": "triton_act",
    "rotary_embedding": "triton_rotary",
    "write_kv_cache": "triton_kv",
    "paged_attention": "triton_attention",
    "quant_matmul": "triton_quant",
    "fused_moe": "triton_moe",
    "lora_shrink": "triton_lora",
    "lora_expand": "triton_lora",
    "latent_attention": "triton_mla",
}

CAPS: dict[str, Caps] = {
    "rms_norm": Caps(dtypes=FLOATS),
    "layer_norm": Caps(dtypes=FLOATS),
    "silu_and_mul": Caps(dtypes=FLOATS),
    "gelu_and_mul": Caps(dtypes=FLOATS),
    # shape-generic: any even rotary dim, any head size, any block size
    "rotary_embedding": Caps(dtypes=FLOATS),
    "write_kv_cache": Caps(dtypes=FLOATS, kv_dtypes=FLOATS),
    "paged_attention": Caps(
        dtypes=FLOATS, kv_dtypes=FLOATS, head_sizes=ATTENTION_HEAD_SIZES, block_sizes=ATTENTION_BLOCK_SIZES,
        alibi=True, softcap=True, sinks=True,
    ),
    # weight-only int8/int4 (any group size, symmetric or with zero points) in Triton, "none" in
    # torch; a8w8 and fp8 weights resolve to the reference. No host sync: graph-capturable.
    "quant_matmul": Caps(dtypes=FLOATS, quant=QUANT_SCHEMES),
    # float and int8 (w8a16, per-channel scales) experts; the topk_ids range check reads back to the
    # host, and is skipped under capture
    "fused_moe": Caps(dtypes=FLOATS, quant=frozenset({"none", "w8a16"}), moe_activations=MOE_ACTIVATIONS),
    # batched multi-LoRA (one adapter slot per row, -1 for none): no host sync, graph-capturable
    "lora_shrink": Caps(dtypes=FLOATS),
    "lora_expand": Caps(dtypes=FLOATS),
    # MLA over a float latent cache, any sizes (padded to powers of two); no host sync
    "latent_attention": Caps(dtypes=FLOATS, kv_dtypes=FLOATS),
}


def launcher_module(op: str) -> ModuleType:
    """The module with `op`'s Triton launcher, imported (with triton) on first use."""
    name = f"{__package__}.{KERNEL_MODULES[op]}"
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Triton RMSNorm, fused residual add (see triton_norm.rms_norm)."""
    return launcher_module("rms_norm").rms_norm(x, weight, eps, residual)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
               residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Triton LayerNorm, optional bias, fused residual add (see triton_norm.layer_norm)."""
    return launcher_module("layer_norm").layer_norm(x, weight, bias, eps, residual)


def silu_and_mul(x: Tensor) -> Tensor:
    """Triton SwiGLU gate (see triton_act.silu_and_mul)."""
    return launcher_module("silu_and_mul").silu_and_mul(x)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """Triton GeGLU gate (see triton_act.gelu_and_mul)."""
    return launcher_module("gelu_and_mul").gelu_and_mul(x, approximate)


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Triton RoPE, in place (see triton_rotary.rotary_embedding)."""
    return launcher_module("rotary_embedding").rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Triton paged-cache store (see triton_kv.write_kv_cache)."""
    return launcher_module("write_kv_cache").write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    alibi_slopes: Tensor | None = None,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Triton paged attention: prefill tiles + split-K decode (see triton_attention.paged_attention)."""
    return launcher_module("paged_attention").paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, alibi_slopes, sliding_window,
        k_scale, v_scale, logit_softcap, sinks,
    )


def quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """Triton weight-only int8/int4 GEMV/GEMM, dequantized in registers (see triton_quant.quant_matmul)."""
    return launcher_module("quant_matmul").quant_matmul(x, weight, bias)


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_scale: Tensor | None = None, w2_scale: Tensor | None = None, w13_bias: Tensor | None = None,
              w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    """Triton grouped-GEMM MoE experts (see triton_moe.fused_moe); float and w8a16 experts, biased and swigluoai
    ones too."""
    return launcher_module("fused_moe").fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, w13_bias,
                                                  w2_bias, activation)


def lora_shrink(x: Tensor, lora_a: Tensor, lora_indices: Tensor) -> Tensor:
    """Triton per-row adapter shrink (see triton_lora.lora_shrink)."""
    return launcher_module("lora_shrink").lora_shrink(x, lora_a, lora_indices)


def lora_expand(out: Tensor, h: Tensor, lora_b: Tensor, lora_indices: Tensor, offset: int) -> Tensor:
    """Triton per-row adapter expand into an output slice (see triton_lora.lora_expand)."""
    return launcher_module("lora_expand").lora_expand(out, h, lora_b, lora_indices, offset)


def latent_attention(q: Tensor, latent: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, slot_mapping: Tensor,
                     block_tables: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                     absorbed: bool = True) -> Tensor:
    """Triton MLA: latent store + latent-space attention over the paged cache (see triton_mla.latent_attention)."""
    return launcher_module("latent_attention").latent_attention(q, latent, kv_cache, kv_b_weight, slot_mapping,
                                                                block_tables, cu_seqlens_q, seq_lens, scale, absorbed)


WRAPPERS = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "silu_and_mul": silu_and_mul,
    "gelu_and_mul": gelu_and_mul,
    "rotary_embedding": rotary_embedding,
    "write_kv_cache": write_kv_cache,
    "paged_attention": paged_attention,
    "quant_matmul": quant_matmul,
    "fused_moe": fused_moe,
    "lora_shrink": lora_shrink,
    "lora_expand": lora_expand,
    "latent_attention": latent_attention,
}


def fp8_quant_matmul(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """fp8 weights and activations through torch._scaled_mm (see scaled_mm.quant_matmul)."""
    from flashllm.backends.cuda.scaled_mm import quant_matmul as scaled

    return scaled(x, weight, bias)


# fp8 needs sm89+: the precision matrix refuses it on older GPUs before this kernel is resolved
FP8_CAPS = Caps(dtypes=frozenset({torch.float16, torch.bfloat16}), quant=frozenset({"fp8"}))


def register(backend: Backend) -> None:
    """Register the Triton kernels on `backend` with their caps, and the fp8 _scaled_mm GEMM."""
    for op, fn in WRAPPERS.items():
        backend.kernel(op, CAPS[op])(fn)
    backend.kernel("quant_matmul", FP8_CAPS)(fp8_quant_matmul)
