"""Mistral against transformers' own MistralForCausalLM: a sliding window shorter than the prompts,
paged KV across block boundaries, chunked prefill, prefix-cache hits, and the cpu backend's kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.models.mistral import DEFAULT_SLIDING_WINDOW
from flashllm.sampling_params import SamplingParams
from flashllm.testing.parity import (
    LogitRecorder,
    assert_logits_close,
    assert_rows_match,
    hf_greedy,
    hf_logits,
    random_tokens,
)

WINDOW = 24     # shorter than most prompts below, and not a multiple of the block size
BLOCK = 16
STEPS = 32
ATOL = 1e-4
PROMPT_LENGTHS = (1, 7, 23, 24, 25, 63, 64, 65, 200)
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}


def build_mistral(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random transformers MistralForCausalLM saved to out_dir; every weight random (norms ~1)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**{**TINY, "sliding_window": WINDOW, **overrides}, architectures=["MistralForCausalLM"])
    torch.manual_seed(seed)
    model = MistralForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 24 is set explicitly (hidden 64 / 4 heads would give 16), as Mistral-Nemo does
    return build_mistral(tmp_path_factory.mktemp("mistral"), seed=3, head_dim=24)


@pytest.fixture(scope="module")
def hf_mistral(mistral_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_the_window_is_read_from_config_json(mistral_dir, ops, model_registry):
    model, config = load_model(mistral_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert config.sliding_windows == (WINDOW, WINDOW)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW, WINDOW]
    assert model.kv_cache_shape() == (2, 2, 24)


def test_the_window_must_change_the_logits(mistral_dir, hf_mistral):
    """Guards the tests below: with prompts past the window, windowed and full attention differ."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, attn_implementation="eager",
                                                sliding_window=None).eval()
    tokens = random_tokens(64, TINY["vocab_size"], seed=1)
    assert (hf_logits(full, tokens)[-1] - hf_logits(hf_mistral, tokens)[-1]).abs().max() > 1e-2


def test_prefill_over_blocks_matches_transformers(mistral_dir, hf_mistral, ops, model_registry, paged_driver):
    ours, _ = load_model(mistral_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=128, seed=2)
    prompts = [random_tokens(n, TINY["vocab_size"], seed=10 + n) for n in PROMPT_LENGTHS]
    outputs = driver.step([(driver.add_sequence(), p) for p in prompts])
    for prompt, logits in zip(prompts, outputs, strict=True):
        assert_logits_close(logits, hf_logits(hf_mistral, prompt), ATOL)


def test_chunked_prefill_beside_decodes_matches_transformers(mistral_dir, hf_mistral, ops, model_registry,
                                                              paged_driver):
    """A prompt in chunks (queries after a cached prefix longer than the window) shares steps with a decode."""
    ours, _ = load_model(mistral_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=64, seed=5)
    long_prompt, short = random_tokens(150, TINY["vocab_size"], seed=6), random_tokens(30, TINY["vocab_size"], seed=7)
    a, b = driver.add_sequence(), driver.add_sequence()
    driver.step([(b, short)])
    for lo, hi in ((0, 37), (37, 100), (100, 150)):
        short.append(random_tokens(1, TINY["vocab_size"], seed=hi)[0])
        chunk_logits, decode_logits = driver.step([(a, long_prompt[lo:hi]), (b, short[-1:])])
        assert_logits_close(chunk_logits, hf_logits(hf_mistral, long_prompt[:hi])[lo:hi], ATOL)
        assert_logits_close(decode_logits, hf_logits(hf_mistral, short)[-1:], ATOL)


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, max_model_len=512, num_kv_blocks=128)
    return LLM(str(model_dir), **{**options, **kw})


GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(backend, mistral_dir, hf_mistral):
    """The engine on the cpu backend's default kernels (and on the reference backend): 32 greedy
    tokens identical and every sampled logits row within 1e-4, with chunked prefill."""
    llm = _llm(mistral_dir, max_num_batched_tokens=48, **({} if backend is None else {"backend": backend}))
    recorder = LogitRecorder(llm)
    prompts = [random_tokens(n, TINY["vocab_size"], seed=20 + n) for n in (1, 7, 25, 63, 65, 200)]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, final = hf_greedy(hf_mistral, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(recorder.rows, prompt, tokens, final, STEPS, atol=ATOL)


def test_prefix_cache_hits_give_transformers_tokens(mistral_dir, hf_mistral):
    llm = _llm(mistral_dir)
    shared = random_tokens(100, TINY["vocab_size"], seed=30)
    prompts = [shared + random_tokens(n, TINY["vocab_size"], seed=31 + n) for n in (3, 40)]
    llm.generate(prompts[:1], GREEDY)  # fills the cache with the shared blocks
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens >= 96 for o in outputs)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_mistral, prompt, STEPS)[0]


def _raw(**overrides) -> dict:
    return {**TINY, "architectures": ["MistralForCausalLM"], "model_type": "mistral", **overrides}


def test_sliding_window_null_means_full_attention_and_absent_means_transformers_default():
    from transformers import MistralConfig

    assert parse_hf_config(_raw(sliding_window=None)).sliding_windows == (None, None)
    absent = parse_hf_config(_raw())
    assert absent.sliding_windows == (MistralConfig().sliding_window,) * 2 == (DEFAULT_SLIDING_WINDOW,) * 2
    # Qwen2's switches do not turn Mistral's window off
    assert parse_hf_config(_raw(sliding_window=8, use_sliding_window=False)).sliding_windows == (8, 8)


@pytest.mark.parametrize("window", [0, -3, 2.5, "4096", True])
def test_a_bad_sliding_window_is_refused_in_one_line(window):
    with pytest.raises(ModelLoadError, match="sliding_window") as info:
        parse_hf_config(_raw(sliding_window=window))
    assert "\n" not in str(info.value)


def test_a_config_with_inconsistent_heads_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw(num_key_value_heads=3)))
    with pytest.raises(ModelLoadError, match="num_key_value_heads=3"):
        parse_hf_config(json.loads((tmp_path / "config.json").read_text()))
