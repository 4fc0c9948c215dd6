"""Random-weight models with the exact shapes of real checkpoints (docs/benchmarks.md), cached locally."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

_COMMON: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "head_dim": 64,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    },
    # Qwen1.5-MoE-A2.7B's routing (60 experts, top-4 not renormalized, a shared expert 4x an expert)
    # and vocabulary, scaled to ~8.0e9 bytes in fp32 (hidden 1024, 16 layers); a decode token reads
    # ~0.42e9 of its 2.0e9 parameters (attention, shared expert, 4 experts a layer, LM head)
    "qwen1.5-moe-scaled": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 151936, "tie_word_embeddings": False,
        "max_position_embeddings": 8192, "rope_theta": 1000000.0, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 2048,
        "decoder_sparse_step": 1, "norm_topk_prob": False, "qkv_bias": True,
    },
    # DeepSeek-V2-Lite's attention as it is (16 heads, no q bottleneck, a 512 + 64 latent row, 128-dim
    # nope/value heads) and routing (64 experts, 6 a token, 2 shared, the first layer dense), hidden
    # 1024 and 12 layers: ~7.6e9 bytes in fp32; a decode token reads ~0.46e9 of its 1.9e9 parameters
    "deepseek-v2-lite-scaled": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 1024,
        "intermediate_size": 5472, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 16,
        "vocab_size": 102400, "tie_word_embeddings": False, "max_position_embeddings": 8192, "rope_theta": 10000.0,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "moe_intermediate_size": 704, "first_k_dense_replace": 1, "topk_method": "greedy",
        "routed_scaling_factor": 1.0,
    },
}


def cache_root() -> Path:
    return Path(os.environ.get("FLASHLLM_CACHE_DIR", Path.home() / ".cache" / "flashllm"))


def shape_model_dir(name: str, dtype: str = "float32") -> Path:
    """Directory of the random-weight model `name` in `dtype`, built once (atomically) and cached."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    target = cache_root() / "shapes" / f"{name}-{dtype}"
    if (target / "config.json").exists():
        return target
    from flashllm.testing.tiny_models import build_random_model_from_config
    from flashllm.testing.tokenizer import train_tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        train_tokenizer(work, vocab_size=512)
        config = {**_COMMON, **SHAPES[name], "torch_dtype": dtype}
        build_random_model_from_config(work, config, seed=0)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def parameter_bytes(model_dir: Path) -> int:
    """Bytes of weights in the directory's safetensors files (what one decode step must read); of a GGUF
    file, its size (a GGUF run's bytes per decode token are the bench's streamed_weight_bytes)."""
    path = Path(model_dir)
    if path.is_file() and path.suffix == ".gguf":
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def active_parameter_bytes(model_dir: Path, dtype_bytes: int) -> int:
    """Bytes of the matmul weights one batch-1 token reads when stored as floats of `dtype_bytes`:
    what transformers' decode step streams (the routed experts of a MoE layer only, the LM head, no
    input embedding table beside it). Norms and biases, a few kilobytes, are left out."""
    return int(flops_per_token(model_dir, 0.0) / 2) * dtype_bytes


def flops_per_token(model_dir: Path, mean_context: float) -> float:
    """FLOPs one token costs in a forward pass: 2 x matmul parameters + attention at `mean_context`.

    Matmul parameters per layer: q/k/v/o projections and the gated MLP's three matrices (a MoE
    layer: its router, the k experts a token goes to and the shared expert); plus the LM head.
    Attention: q.k scores and the weighted sum of v over the context, 2 x 2 x heads x head_dim x
    context per layer. Embedding lookups and norms are not matmuls.
    """
    from flashllm.models.hf_config import load_hf_config

    c = load_hf_config(model_dir)
    if hasattr(c, "flops_per_token"):  # an architecture that counts its own (DeepSeek's MLA and routing)
        return c.flops_per_token(mean_context)
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size
    mlps = [3 * c.hidden_size * c.intermediate_size] * c.num_hidden_layers
    if getattr(c, "sparse_layers", ()):  # a MoE layer runs its router, k experts and the shared expert
        moe = c.hidden_size * (c.num_experts + 3 * c.num_experts_per_tok * c.moe_intermediate_size
                               + 3 * c.shared_expert_intermediate_size)
        mlps = [moe if sparse else dense for sparse, dense in zip(c.sparse_layers, mlps, strict=True)]
    params = c.num_hidden_layers * attn + sum(mlps) + c.vocab_size * c.hidden_size
    attention = c.num_hidden_layers * 4 * q_dim * mean_context
    return 2.0 * params + attention
