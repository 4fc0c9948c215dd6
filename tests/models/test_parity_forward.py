"""flashllm's Llama-family models over a paged KV cache give transformers' logits (prefill, chunks, decode)."""

from __future__ import annotations

import pytest
import torch

from flashllm.models.loader import load_model
from flashllm.testing.parity import assert_logits_close, hf_logits, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PRESETS = ("llama", "llama3", "llama-tied", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "ernie4_5",
           "smollm3", "olmo", "helium", "apertus", "olmo2", "olmo3", "gemma", "exaone4", "seed_oss", "hunyuan", "hunyuan_moe", "dots1", "minimax_m2", "exaone_moe", "afmoe", "solar_open", "llama4", "starcoder2", "arcee",
           "cohere", "cohere2",
           "ministral", "persimmon", "minicpm3", "cwm",
           "nemotron", "phi", "stablelm", "gpt_neox", "bloom", "mpt", "gptj", "codegen", "falcon", "gpt_bigcode", "gpt2", "opt", "gpt_neo", "xglm")
CHUNKED = tuple(p for p in PRESETS if p not in ("llama", "llama-tied"))  # the plain Llamas add nothing here
# LongRoPE: a whole prompt in one pass uses the factor set transformers' full forward does; its decodes
# and chunks across original_max_position_embeddings are checked against transformers' cached generation
# in tests/models/test_phi3.py
# recurrent models: prefill only here (this driver keeps no state); their decodes and chunks are in their own files
PREFILL_PRESETS = (*PRESETS, "phi3-longrope", "mamba2", "bamba", "granitemoehybrid", "nemotron_h", "lfm2", "mamba", "falcon_mamba",
                   "jamba")
PROMPT_LENGTHS = (1, 7, 63, 64, 65, 200)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
@pytest.mark.parametrize("preset", PREFILL_PRESETS)
def test_prefill_one_sequence_matches_transformers(preset, length, loaded_pair, paged_driver):
    ours, theirs = loaded_pair(preset)
    tokens = random_tokens(length, ours.config.vocab_size, seed=length)
    driver = paged_driver(ours, block_size=64, num_blocks=8, seed=length)
    seq = driver.add_sequence()
    (logits,) = driver.step([(seq, tokens)])
    assert_logits_close(logits, hf_logits(theirs, tokens))


@pytest.mark.parametrize("preset", PREFILL_PRESETS)
def test_prefill_varlen_batch_matches_transformers(preset, loaded_pair, paged_driver):
    ours, theirs = loaded_pair(preset)
    driver = paged_driver(ours, block_size=16, num_blocks=64, seed=3)
    prompts = [random_tokens(n, ours.config.vocab_size, seed=100 + n) for n in PROMPT_LENGTHS]
    outputs = driver.step([(driver.add_sequence(), p) for p in prompts])
    for prompt, logits in zip(prompts, outputs, strict=True):
        assert_logits_close(logits, hf_logits(theirs, prompt))


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_decode_steps_match_transformers(preset, loaded_pair, paged_driver):
    """Prefill three sequences together, then decode them together one token at a time."""
    ours, theirs = loaded_pair(preset)
    driver = paged_driver(ours, block_size=16, num_blocks=32, seed=4)
    prompts = [random_tokens(n, ours.config.vocab_size, seed=200 + n) for n in (7, 63, 64)]
    seqs = [driver.add_sequence() for _ in prompts]
    outputs = driver.step(list(zip(seqs, prompts, strict=True)))
    for _ in range(4):
        for prompt, logits in zip(prompts, outputs, strict=True):
            prompt.append(int(logits[-1].argmax()))
        outputs = driver.step([(seq, [prompt[-1]]) for seq, prompt in zip(seqs, prompts, strict=True)])
        for prompt, logits in zip(prompts, outputs, strict=True):
            assert_logits_close(logits, hf_logits(theirs, prompt)[-1:])


@pytest.mark.parametrize("preset", CHUNKED)
def test_chunked_prefill_beside_decode_matches_transformers(preset, loaded_pair, paged_driver):
    """A prompt split into chunks (queries after a cached prefix) shares batches with a decode."""
    ours, theirs = loaded_pair(preset)
    driver = paged_driver(ours, block_size=16, num_blocks=32, seed=5)
    long_prompt = random_tokens(150, ours.config.vocab_size, seed=6)
    short = random_tokens(20, ours.config.vocab_size, seed=7)
    a, b = driver.add_sequence(), driver.add_sequence()
    driver.step([(b, short)])
    for lo, hi in ((0, 37), (37, 100), (100, 150)):
        short.append(random_tokens(1, ours.config.vocab_size, seed=hi)[0])
        chunk_logits, decode_logits = driver.step([(a, long_prompt[lo:hi]), (b, short[-1:])])
        assert_logits_close(chunk_logits, hf_logits(theirs, long_prompt[:hi])[lo:hi])
        assert_logits_close(decode_logits, hf_logits(theirs, short)[-1:])


def test_qwen2_sliding_window_layers_match_transformers(tmp_path, ops, model_registry, paged_driver):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "qwen2", seed=2, tokenizer=False, use_sliding_window=True,
                                 sliding_window=16, max_window_layers=1)
    ours, config = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert config.sliding_windows == (None, 16)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    tokens = random_tokens(70, config.vocab_size, seed=8)
    driver = paged_driver(ours, block_size=16, num_blocks=16)
    (logits,) = driver.step([(driver.add_sequence(), tokens)])
    assert_logits_close(logits, hf_logits(theirs.eval(), tokens))


def test_tied_presets_share_one_table(loaded_pair):
    for preset, tied in (("llama", False), ("llama-tied", True), ("qwen2", True)):
        ours, _ = loaded_pair(preset)
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) is tied
        assert ours.config.tie_word_embeddings is tied


def test_kv_cache_shape_follows_config(loaded_pair):
    ours, theirs = loaded_pair("llama")
    cfg = theirs.config
    assert ours.kv_cache_shape() == (
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    )
    assert ours.max_position == cfg.max_position_embeddings
