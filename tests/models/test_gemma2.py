"""Gemma 2 (and Gemma 1's config) against transformers' Gemma2ForCausalLM / GemmaConfig: the Hub's config layout and transformers' defaults, and the
two caps (attention scores, logits) changing what the model computes. The tiny model's paged-forward and engine
parity (sliding and full layers alternating, chunked prefill, decode) run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.loading import load_flashllm
from flashllm.testing.parity import assert_logits_close, hf_logits, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

# google/gemma-2-2b-it's config.json as the Hub has it (transformers 4.42's layout), shrunk
HUB_2B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 32, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 5, "num_key_value_heads": 2,
    "pad_token_id": 0, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 16, "torch_dtype": "float32", "vocab_size": 256,
}


def test_the_hub_layout_reads_as_transformers_reads_it() -> None:
    """Even layers slide (transformers' default layer_types), one RoPE, both caps; left out, the caps take
    Gemma2Config's defaults; null, they are off."""
    from transformers import Gemma2Config

    ours, theirs = parse_hf_config(HUB_2B), Gemma2Config(**HUB_2B)
    assert ours.sliding_windows == tuple(16 if t == "sliding_attention" else None for t in theirs.layer_types)
    assert ours.sliding_windows == (16, None, 16, None, 16)
    assert ours.rope_theta == ours.local_rope_theta == theirs.rope_parameters["rope_theta"]
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (50.0, 30.0) and not ours.qk_norm
    left_out = {k: v for k, v in HUB_2B.items() if not k.endswith("softcapping")}
    defaults, their_defaults = parse_hf_config(left_out), Gemma2Config(**left_out)
    assert defaults.attn_logit_softcapping == their_defaults.attn_logit_softcapping
    assert defaults.final_logit_softcapping == their_defaults.final_logit_softcapping
    off = parse_hf_config({**HUB_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert off.attn_logit_softcapping is None and off.final_logit_softcapping is None


@pytest.mark.parametrize(("overrides", "field"), [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
])
def test_what_gemma2_cannot_run_is_refused_in_one_line(overrides, field) -> None:
    with pytest.raises(ModelLoadError, match=field) as info:
        parse_hf_config({**HUB_2B, **overrides})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_cap_changes_the_logits_as_transformers_does(cap, tmp_path, paged_driver, ops) -> None:
    """The tiny preset's caps bite: without one of them (null), transformers' logits move, and flashllm's
    follow them to 1e-4 both ways."""
    from transformers import AutoModelForCausalLM

    capped = build_tiny_model(tmp_path / "capped", "gemma2", seed=4, tokenizer=False)
    uncapped = build_tiny_model(tmp_path / "uncapped", "gemma2", seed=4, tokenizer=False, **{cap: None})
    prompt = random_tokens(40, 256, seed=3)
    expected = {}
    for name, model_dir in (("capped", capped), ("uncapped", uncapped)):
        theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        expected[name] = hf_logits(theirs, prompt)
        driver = paged_driver(load_flashllm(model_dir, ops), block_size=16, num_blocks=16, seed=1)
        assert_logits_close(driver.step([(driver.add_sequence(), prompt)])[0], expected[name])
    assert (expected["capped"] - expected["uncapped"]).abs().max() > 1e-2


# google/gemma-2b's config.json (transformers 4.38's layout), shrunk: the legacy hidden_act "gelu"
HUB_GEMMA_2B = {
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": False, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 32, "hidden_act": "gelu", "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256,
}


def test_gemma_1_reads_as_transformers_reads_it() -> None:
    """Gemma 1: "gelu" is the tanh GeGLU (transformers rewrites it so), full attention scaled by head_dim ** -0.5,
    no caps, no q / k norms; another activation is refused."""
    from transformers import GemmaConfig

    ours, theirs = parse_hf_config(HUB_GEMMA_2B), GemmaConfig(**HUB_GEMMA_2B)
    assert theirs.hidden_act == "gelu_pytorch_tanh" and ours.gelu_approximate == "tanh"
    assert ours.sliding_windows == (None, None, None) and ours.query_pre_attn_scalar == 32.0
    assert ours.attn_logit_softcapping is None and ours.final_logit_softcapping is None and not ours.qk_norm
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings is True
    with pytest.raises(ModelLoadError, match="hidden_act='silu'"):
        parse_hf_config({**HUB_GEMMA_2B, "hidden_act": "silu"})
