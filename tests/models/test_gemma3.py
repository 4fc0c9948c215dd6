"""Gemma 3 (text) against transformers' Gemma3ForCausalLM: sliding and full layers with their own RoPE, a
window shorter than the prompts, logit softcapping, the engine on the reference and cpu backends (which must not
take Llama's fused decoder stack), and config.json's layouts and refusals.

The tiny model's paged-forward parity (prefill, varlen batches, decode, chunked prefill) runs in
test_parity_forward.py with the other presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
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
from flashllm.testing.tiny_models import PRESETS, build_tiny_model

WINDOW = PRESETS["gemma3"][1]["sliding_window"]  # 8: every prompt below but one is longer
STEPS = 24
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)

# google/gemma-3-1b-it's config.json as the Hub has it (transformers 4.50's layout), shrunk
HUB_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None,
    "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 13, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "vocab_size": 256,
}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", seed=5, tokenizer=False)


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def test_the_layers_alternate_windows_and_rotary_tables(gemma_dir, hf_gemma):
    ours = load_flashllm(gemma_dir)
    assert ours.config.sliding_windows == (WINDOW, None, WINDOW, None) == tuple(
        WINDOW if t == "sliding_attention" else None for t in hf_gemma.config.layer_types)
    stack = ours.model
    assert [layer.self_attn.rotary_emb for layer in stack.layers] == [stack.rotary_emb_local, stack.rotary_emb] * 2
    assert {layer.self_attn.attn.scale for layer in stack.layers} == {hf_gemma.config.query_pre_attn_scalar ** -0.5}


def test_the_window_must_change_the_logits(gemma_dir, hf_gemma):
    """Guards the parity tests: past the window, windowed and full attention give other logits."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32, sliding_window=4096).eval()
    tokens = random_tokens(40, hf_gemma.config.vocab_size, seed=1)
    assert (hf_logits(full, tokens)[-1] - hf_logits(hf_gemma, tokens)[-1]).abs().max() > 1e-2


def test_final_logit_softcapping_caps_as_transformers(tmp_path, paged_driver):
    """A cap of 2 squeezes logits of order 5: uncapped ones would miss by far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "gemma3", seed=6, tokenizer=False, final_logit_softcapping=2.0)
    ours, theirs = load_flashllm(model_dir), AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert declared(ours, LM_HEAD, LMHeadFusion) is None  # compute_logits is not the plain head any more
    tokens = random_tokens(30, ours.config.vocab_size, seed=2)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=8)
    (logits,) = driver.step([(driver.add_sequence(), tokens)])
    expected = hf_logits(theirs.eval(), tokens)
    uncapped = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, final_logit_softcapping=None)
    assert (hf_logits(uncapped.eval(), tokens) - expected).abs().max() > 1.0
    assert_logits_close(logits, expected)


@pytest.mark.parametrize(("scheme", "group_size"), [("w8a16", -1), ("w4a16", 32)])
def test_weight_only_quantization_is_transformers_on_the_rounded_weights(scheme, group_size, gemma_dir, paged_driver):
    """The declared --quant_type schemes: every projection quantized, and the logits those of transformers' model
    whose projections hold the same rounded weights (each output row is quantized alone, so q, k, v rounded
    apart equal qkv_proj rounded whole). A random Gemma amplifies int8 rounding to ~7% of the logits (transformers'
    own model too), so tracking the float model would prove little."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in theirs.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":  # the head stays float (tied)
                module.weight.copy_(dequantize(quantize_weight(module.weight, scheme, group_size)))
    ours = load_flashllm(gemma_dir, quant=WeightQuantSpec(scheme, group_size))
    linears = [m for m in ours.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 16 and {m.qweight.scheme for m in linears} == {scheme}
    tokens = random_tokens(40, ours.config.vocab_size, seed=9)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=8)
    (logits,) = driver.step([(driver.add_sequence(), tokens)])
    assert_logits_close(logits, hf_logits(theirs, tokens))


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, max_model_len=256, num_kv_blocks=64)
    return LLM(str(model_dir), **{**options, **kw})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(backend, gemma_dir, hf_gemma):
    """The engine on the cpu backend's kernels and on the reference backend, with chunked prefill: greedy tokens
    identical and every sampled logits row within 1e-4; the cpu backend runs the model's own forward (Gemma
    declares no decoder-stack fusion), its LM head fusion still offered."""
    llm = _llm(gemma_dir, max_num_batched_tokens=48, backend=backend)
    model = llm.engine.parts.model
    assert model.ops.sources["paged_attention"] == backend
    assert declared(model, DECODER_STACK, DecoderStackFusion) is None
    assert declared(model, LM_HEAD, LMHeadFusion) is not None
    recorder = LogitRecorder(llm)
    vocab = hf_gemma.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=20 + n) for n in (1, 7, 9, 40, 100)]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, final = hf_greedy(hf_gemma, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(recorder.rows, prompt, tokens, final, STEPS, atol=1e-4)


def test_the_hub_layout_reads_as_transformers_reads_it():
    """sliding_window_pattern 6 (every sixth layer full), rope_theta / rope_local_base_freq and the defaults of
    fields the file leaves out (tie_word_embeddings) as transformers' Gemma3TextConfig gives them."""
    from transformers import Gemma3TextConfig

    theirs = Gemma3TextConfig(**HUB_1B)
    ours = parse_hf_config(HUB_1B)
    assert ours.sliding_windows == tuple(512 if t == "sliding_attention" else None for t in theirs.layer_types)
    assert ours.sliding_windows.count(None) == 2
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"] and ours.rope_scaling is None
    assert ours.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings is True
    assert ours.eos_token_id == [1, 106] and ours.query_pre_attn_scalar == 32.0
    scaled = parse_hf_config({**HUB_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0} and scaled.local_rope_scaling is None


@pytest.mark.parametrize(("overrides", "field"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"rope_theta": 1e6}}, "rope_parameters"),
])
def test_what_gemma3_cannot_run_is_refused_in_one_line(overrides, field):
    with pytest.raises(ModelLoadError, match=field) as info:
        parse_hf_config({**HUB_1B, **overrides})
    assert "\n" not in str(info.value)
