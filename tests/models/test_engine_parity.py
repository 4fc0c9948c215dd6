"""The whole engine against transformers: logits and greedy tokens through continuous batching,
paged KV across block boundaries, prefix-cache hits, chunked prefill and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.backends.cpu import greedy_screen, native
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.greedy_rows import greedy_screen_rows
from flashllm.testing.tiny_models import build_tiny_model

PROMPT_LENGTHS = (1, 7, 63, 64, 65, 200)
STEPS = 32
BLOCK = 16  # small blocks so prompts and decodes cross many block boundaries
PRESETS = ("llama", "llama3", "llama-tied", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "ernie4_5",
           "smollm3", "olmo", "helium", "apertus", "olmo2", "olmo3", "gemma", "exaone4", "seed_oss", "hunyuan", "hunyuan_moe", "dots1", "minimax_m2", "exaone_moe", "afmoe", "solar_open", "llama4", "starcoder2", "arcee",
           "cohere", "cohere2",
           "ministral", "persimmon", "minicpm3", "cwm", "mamba2", "bamba", "granitemoehybrid", "nemotron_h",
           "nemotron", "phi", "stablelm", "gpt_neox", "bloom", "mpt", "gptj", "codegen", "falcon", "gpt_bigcode", "gpt2", "opt", "gpt_neo", "xglm", "lfm2")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {p: build_tiny_model(tmp_path_factory.mktemp(p), p, seed=3, tokenizer=False)
            for p in PRESETS}


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    return {p: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for p, d in model_dirs.items()}


def _prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


class LogitRecorder:
    """Wraps a runner's execute() to keep every logits row with the sequence and position it scored.

    Greedy steps take the logits path too (their tokens are those logits' argmax), so every step
    has rows to check, and one at a time (no multi-step calls, which run steps without execute_model); the cpu
    backend's greedy screen and bursts, which skip the logits, are checked against transformers'
    tokens without a recorder (test_the_greedy_screen_gives_the_same_tokens)."""

    def __init__(self, llm: LLM) -> None:
        self.rows: list[tuple[int, list[int], torch.Tensor]] = []
        llm.engine.config.scheduler.num_scheduler_steps = 1
        runner, original = llm.engine.runner, llm.engine.runner.execute_model

        def execute_model(batch, greedy=False):
            logits = original(batch)
            samplers = [item.seq for item in batch.scheduled if item.produces_token]
            for seq, row in zip(samplers, logits, strict=True):
                self.rows.append((seq.seq_id, list(seq.token_ids), row.clone()))
            return runner.argmax(logits) if greedy else logits

        runner.execute_model = execute_model


def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by repeated full forwards (independent of HF's cache code): tokens, logits."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0]
            ids.append(int(logits[-1].argmax()))
        final = model(torch.tensor([ids])).logits[0]
    return ids[len(prompt):], final


def _check_against_hf(hf_model, prompts: list[list[int]], recorder: LogitRecorder, outputs) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, hf_logits = _hf_greedy(hf_model, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        full = prompt + tokens
        rows = [(ctx, row) for _, ctx, row in recorder.rows if ctx == full[: len(ctx)] and len(ctx) >= len(prompt)]
        assert len(rows) >= STEPS, f"prompt of {len(prompt)} tokens: only {len(rows)} logits rows recorded"
        for ctx, row in rows:
            torch.testing.assert_close(row, hf_logits[len(ctx) - 1], atol=1e-4, rtol=0)


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, max_model_len=512, num_kv_blocks=128)
    options.update(kw)
    return LLM(str(model_dir), **options)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "gemma3"])
def test_logits_and_greedy_tokens_match_transformers(preset, model_dirs, hf_models) -> None:
    llm = _llm(model_dirs[preset])
    recorder = LogitRecorder(llm)
    prompts = _prompts(hf_models[preset].config.vocab_size)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    _check_against_hf(hf_models[preset], prompts, recorder, outputs)
    assert llm.engine.num_free_blocks() == llm.engine.block_manager.num_total_blocks


@pytest.mark.parametrize("preset", ["llama", "llama-tied", "qwen2", "qwen3", "gemma3", "phi3", "granite", "ernie4_5",
                                    "smollm3", "cohere", "cohere2"])
def test_the_greedy_screen_gives_the_same_tokens(preset, model_dirs, hf_models) -> None:
    """Greedy steps through the device's greedy head (on the cpu backend, the bf16 screen of the
    LM head): transformers' greedy tokens, with prefix-cache hits and prefill chunks on the way."""
    llm = _llm(model_dirs[preset], max_num_batched_tokens=48, max_num_seqs=greedy_screen_rows())  # batches it takes
    vocab = hf_models[preset].config.vocab_size
    prompts = _prompts(vocab, (1, 7, 63, 65, 200), seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    llm.generate(prompts[-1:], params)  # cached blocks for the repeat below
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(hf_models[preset], prompt, STEPS)[0]
    screen = greedy_screen.kept(llm.engine.parts.model)
    assert screen is not None or native.library() is None
    assert screen is None or screen.picked >= len(prompts) * STEPS


def test_prefix_cache_hits_give_the_same_logits(model_dirs, hf_models) -> None:
    llm = _llm(model_dirs["llama"])
    vocab = hf_models["llama"].config.vocab_size
    shared = _prompts(vocab, (100,), seed=5)[0]
    prompts = [shared + tail for tail in _prompts(vocab, (3, 40), seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    llm.generate(prompts[:1], params)  # fills the cache with the shared blocks
    recorder = LogitRecorder(llm)
    outputs = llm.generate(prompts, params)
    assert all(o.metrics.num_cached_tokens >= 96 for o in outputs)  # 6 full blocks of 16 hit
    _check_against_hf(hf_models["llama"], prompts, recorder, outputs)


def test_chunked_prefill_matches(model_dirs, hf_models) -> None:
    llm = _llm(model_dirs["qwen2"], max_num_batched_tokens=48)
    recorder = LogitRecorder(llm)
    prompts = _prompts(hf_models["qwen2"].config.vocab_size, (200, 65, 7), seed=7)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    _check_against_hf(hf_models["qwen2"], prompts, recorder, outputs)


def test_prefill_cap_matches(model_dirs, hf_models) -> None:
    """max_prefill_tokens (serve's CPU default): prompts prefilled a few tokens a step while the
    earlier ones decode alongside give transformers' logits and tokens."""
    llm = _llm(model_dirs["qwen2"], max_prefill_tokens=40)
    recorder = LogitRecorder(llm)
    prompts = _prompts(hf_models["qwen2"].config.vocab_size, (30, 65, 7, 90), seed=12)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    _check_against_hf(hf_models["qwen2"], prompts, recorder, outputs)


def test_forced_preemption_recomputes_identically(model_dirs, hf_models) -> None:
    # 32 blocks of 16 tokens: six growing sequences cannot all stay resident.
    llm = _llm(model_dirs["llama"], num_kv_blocks=32, enable_prefix_caching=False)
    recorder = LogitRecorder(llm)
    prompts = _prompts(hf_models["llama"].config.vocab_size, (60, 70, 80, 90, 100, 50), seed=8)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    _check_against_hf(hf_models["llama"], prompts, recorder, outputs)
    assert llm.engine.num_free_blocks() == 32


def test_twenty_mixed_requests_batched_equal_each_alone(model_dirs, hf_models) -> None:
    llm = _llm(model_dirs["llama-tied"], max_num_batched_tokens=128)
    lengths = [1 + (i * 37) % 150 for i in range(20)]
    prompts = _prompts(hf_models["llama-tied"].config.vocab_size, lengths, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (i * 7) % 20, ignore_eos=True) for i in range(20)]
    together = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], sp)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_same_seed_same_sample_alone_and_in_a_batch(model_dirs, hf_models) -> None:
    llm = _llm(model_dirs["qwen2"])
    prompts = _prompts(hf_models["qwen2"].config.vocab_size, (9, 30, 64, 3), seed=10)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    batch = llm.generate(prompts, [seeded, others, others, others])[0].outputs[0].token_ids
    again = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    assert alone == batch == again
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4321, ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed)[0].outputs[0].token_ids != alone


def test_engine_refuses_a_cache_that_cannot_hold_one_max_length_sequence(model_dirs) -> None:
    from flashllm.core.builder import EngineConfigError

    with pytest.raises(EngineConfigError, match=r"holds 8 blocks \(128 tokens\).*max_model_len 512 needs 32 blocks"):
        _llm(model_dirs["llama"], num_kv_blocks=8)


def test_prompt_longer_than_max_model_len_is_rejected(model_dirs) -> None:
    llm = _llm(model_dirs["llama"], max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="the prompt has 64 tokens; max_model_len is 64"):
        llm.generate([[1, 2, 3], list(range(64))], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished() and llm.engine.num_free_blocks() == 8
