"""Tiny random GLM checkpoints (transformers' GlmForCausalLM: partial adjacent-pair rotary, q/k/v biases, fused
gate_up_proj, grouped key/value heads; Glm4ForCausalLM: the same with post-attention and post-MLP norms), for the
GLM model and GGUF tests."""

from __future__ import annotations

from typing import Any

import torch

HIDDEN, FFN, LAYERS, HEADS, GROUPS, HEAD_DIM, VOCAB, SEQ = 64, 128, 2, 4, 2, 16, 256, 512
ROPE_RATIO = 5.0  # ChatGLM's base 10000 times rope_ratio is GLM's rope_theta
EPS = 1e-5


def build_glm(seed: int, vocab_size: int = VOCAB, glm4: bool = False, **overrides: Any) -> Any:
    """transformers' GlmForCausalLM (Glm4ForCausalLM with `glm4`) of the tiny shapes, every parameter random (norm
    scales around 1). overrides: config fields over the tiny ones."""
    import transformers

    fields = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM, max_position_embeddings=SEQ,
        rms_norm_eps=EPS, attention_bias=True, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0 * ROPE_RATIO, "partial_rotary_factor": 0.5},
        architectures=["Glm4ForCausalLM" if glm4 else "GlmForCausalLM"],
    )
    config_cls, model_cls = ((transformers.Glm4Config, transformers.Glm4ForCausalLM) if glm4
                             else (transformers.GlmConfig, transformers.GlmForCausalLM))
    model = model_cls(config_cls(**{**fields, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(noise + 1.0 if "norm" in name else noise)
    return model
