"""Hunyuan dense (HunYuanDenseV1ForCausalLM): the fixed NTK alpha read into the RoPE base as transformers computes it,
in both config layouts, and the checkpoint's query_layernorm / key_layernorm names. The tiny model's paged-forward and
engine parity with transformers (norms after RoPE, alpha 50) run in test_parity_forward.py and test_engine_parity.py
with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.ops.rope_cache import rope_inv_freq

RAW = {"architectures": ["HunYuanDenseV1ForCausalLM"], "model_type": "hunyuan_v1_dense", "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}},
    {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}},  # the Hub's
])
def test_the_alpha_stretches_the_rope_base_as_transformers_does(rope) -> None:
    from transformers import HunYuanDenseV1Config
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    ours = parse_hf_config({**RAW, **rope})
    theirs = HunYuanDenseV1RotaryEmbedding(HunYuanDenseV1Config(**{**RAW, **rope})).inv_freq
    assert ours.rope_scaling is None
    inv_freq, _ = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(inv_freq.float(), theirs.float(), rtol=1e-6, atol=0)
    plain, _ = rope_inv_freq(32, 10000.0, None)
    assert (plain - inv_freq).abs().max() > 1e-3


def test_an_alpha_on_another_rope_type_is_refused_in_one_line() -> None:
    with pytest.raises(ModelLoadError, match="rope alpha with rope type 'linear'") as info:
        parse_hf_config({**RAW, "rope_scaling": {"type": "linear", "factor": 2.0, "alpha": 3.0}})
    assert "\n" not in str(info.value)


def test_the_checkpoint_names_its_head_norms_query_layernorm_and_key_layernorm(tmp_path) -> None:
    from safetensors import safe_open

    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "hunyuan", seed=1, tokenizer=False)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.query_layernorm.weight", "model.layers.0.self_attn.key_layernorm.weight"} <= names
