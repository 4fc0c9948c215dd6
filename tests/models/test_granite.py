"""Granite 3.x (GraniteForCausalLM) against transformers: each of its four multipliers, the engine's logits, greedy
tokens and logprobs on the reference and cpu backends with chunked prefill (the cpu backend must not take Llama's
fused decoder stack; its greedy LM head screen only for a logits_scaling that keeps the argmax), and config.json's
defaults and refusals.

The tiny model's paged-forward parity (prefill, varlen batches, decode, chunked prefill) runs in
test_parity_forward.py, and the cpu engine's logits and screened greedy tokens in test_engine_parity.py, with the
other presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.backends.cpu import greedy_screen
from flashllm.llm import LLM
from flashllm.models.granite import MULTIPLIERS
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.linear import LinearBase
from flashllm.ops.quant_matmul import dequantize
from flashllm.quant import quantize_weight
from flashllm.quant.spec import WeightQuantSpec
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD, DecoderStackFusion, LMHeadFusion, declared
from flashllm.sampling_params import SamplingParams
from flashllm.testing.loading import load_flashllm
from flashllm.testing.parity import (
    LogitRecorder,
    assert_logits_close,
    assert_rows_match,
    hf_greedy,
    hf_logits,
    random_tokens,
)
from flashllm.testing.tiny_models import PRESETS, TINY_BASE, build_tiny_model

GRANITE = PRESETS["granite"][1]
STEPS = 16
BLOCK = 16
CONFIG = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 256, **TINY_BASE}


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("granite"), "granite", seed=7, tokenizer=False)


@pytest.fixture(scope="module")
def hf_granite(granite_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(granite_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", MULTIPLIERS)
def test_each_multiplier_changes_the_logits(name, granite_dir, hf_granite):
    """Guards the parity tests: transformers' model without any one of the preset's multipliers (set to 1, or to
    head_dim ** -0.5 for the score scale Llama would use) gives other logits by far more than their tolerance."""
    from transformers import AutoModelForCausalLM

    plain = 16 ** -0.5 if name == "attention_multiplier" else 1.0
    other = AutoModelForCausalLM.from_pretrained(granite_dir, dtype=torch.float32, **{name: plain}).eval()
    tokens = random_tokens(30, hf_granite.config.vocab_size, seed=1)
    assert (hf_logits(other, tokens) - hf_logits(hf_granite, tokens)).abs().max() > 1e-2


@pytest.mark.parametrize(("scheme", "group_size"), [("w8a16", -1), ("w4a16", 32)])
def test_weight_only_quantization_is_transformers_on_the_rounded_weights(scheme, group_size, granite_dir,
                                                                          paged_driver):
    """--quant_type: the residual multiplier is not folded into o_proj / down_proj, so each projection quantizes
    the checkpoint's own weights and the logits are those of transformers' model holding the same rounded ones."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(granite_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in theirs.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":  # the head stays float
                module.weight.copy_(dequantize(quantize_weight(module.weight, scheme, group_size)))
    ours = load_flashllm(granite_dir, quant=WeightQuantSpec(scheme, group_size))
    assert {m.qweight.scheme for m in ours.modules() if isinstance(m, LinearBase)} == {scheme}
    tokens = random_tokens(40, ours.config.vocab_size, seed=9)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=8)
    (logits,) = driver.step([(driver.add_sequence(), tokens)])
    assert_logits_close(logits, hf_logits(theirs, tokens))


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, max_model_len=256, num_kv_blocks=64)
    return LLM(str(model_dir), **{**options, **kw})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_logits_tokens_and_logprobs_match_transformers(backend, granite_dir, hf_granite):
    """Chunked prefill (48-token batches) beside decodes: greedy tokens identical, every sampled logits row and
    every chosen token's logprob (which logits_scaling changes) within 1e-4; the cpu backend runs the model's own
    forward (no decoder-stack record carries the multipliers) and is offered the LM head with its divisor."""
    llm = _llm(granite_dir, max_num_batched_tokens=48, backend=backend)
    model = llm.engine.parts.model
    assert model.ops.sources["paged_attention"] == backend
    assert declared(model, DECODER_STACK, DecoderStackFusion) is None
    assert declared(model, LM_HEAD, LMHeadFusion).logits_scale == GRANITE["logits_scaling"]
    recorder = LogitRecorder(llm)
    prompts = [random_tokens(n, hf_granite.config.vocab_size, seed=30 + n) for n in (1, 9, 40, 100)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, final = hf_greedy(hf_granite, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(recorder.rows, prompt, tokens, final, STEPS, atol=1e-4)
        expected = torch.log_softmax(final[len(prompt) - 1:-1], dim=-1)[torch.arange(STEPS), tokens]
        torch.testing.assert_close(torch.tensor(output.outputs[0].logprobs), expected, atol=1e-4, rtol=0)


def test_the_greedy_screen_declines_a_divisor_that_is_not_a_power_of_two(tmp_path):
    """Greedy steps without logprobs: the cpu backend's screen finds the argmax of the head's product, which a
    division by 6 may tie where the product does not, so it declines the head and the engine takes the argmax of
    the divided logits: transformers' tokens. (With the preset's 8 it screens every step: test_engine_parity.py.)"""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "granite", seed=8, tokenizer=False, logits_scaling=6.0)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = _llm(model_dir)
    assert declared(llm.engine.parts.model, LM_HEAD, LMHeadFusion).logits_scale == 6.0
    prompts = [random_tokens(n, theirs.config.vocab_size, seed=50 + n) for n in (5, 60)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(theirs, prompt, STEPS)[0]
    assert greedy_screen.kept(llm.engine.parts.model) is None


def test_absent_multipliers_are_transformers_defaults():
    """GraniteConfig's defaults are 1.0 for all four, the score scale included (not head_dim ** -0.5); a
    sliding_window in config.json is ignored, as transformers' Granite ignores it."""
    from transformers import GraniteConfig

    ours, theirs = parse_hf_config({**CONFIG, "sliding_window": 8}), GraniteConfig(**CONFIG)
    assert all(getattr(ours, name) == getattr(theirs, name) == 1.0 for name in MULTIPLIERS)
    assert ours.sliding_windows == (None,) * TINY_BASE["num_hidden_layers"]
    given = parse_hf_config({**CONFIG, **GRANITE})
    assert {name: getattr(given, name) for name in MULTIPLIERS} == GRANITE


@pytest.mark.parametrize("name", MULTIPLIERS)
@pytest.mark.parametrize("value", [0, -1.0, "8", float("inf")])
def test_a_multiplier_that_is_not_a_finite_positive_number_is_refused(name, value):
    with pytest.raises(ModelLoadError, match=name) as info:
        parse_hf_config({**CONFIG, name: value})
    assert "\n" not in str(info.value)
