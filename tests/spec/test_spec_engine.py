"""Speculative decoding in the engine: greedy tokens exactly as without it, under continuous batching with
preemption, chunked prefill and prefix caching; stops, max_tokens and logprobs inside accepted runs;
seeded sampling independent of the batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flashllm.config import MAX_DRAFT_TOKENS
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.tiny_models import build_tiny_model
from flashllm.testing.tiny_moe import build_moe_model

BLOCK = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {p: build_tiny_model(tmp_path_factory.mktemp(p), p, seed=3, tokenizer=False) for p in ("llama", "qwen2", "qwen3")}
    for preset in ("mixtral", "qwen2_moe"):  # experts chosen per token: drafts must not change which
        dirs[preset] = build_moe_model(tmp_path_factory.mktemp(preset), preset, seed=3)
    return dirs


def _requests(count: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompt lengths (1..150 tokens), some repeating a span of themselves so lookups find drafts,
    and mixed max_tokens (1..40)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 110))]
        if len(prompt) > 4 and rng.random() < 0.7:
            start = rng.randrange(len(prompt) - 2)
            prompt += prompt[start:start + rng.randrange(2, 40)]
        out.append((prompt, SamplingParams(max_tokens=rng.randrange(1, 41), temperature=0.0, ignore_eos=True)))
    return out


def _generate(model_dir: Path, backend: str, requests, speculative=None, **kwargs) -> tuple[list[list[int]], LLM]:
    options = {"block_size": BLOCK, "num_kv_blocks": 96, "max_num_seqs": 24, "max_num_batched_tokens": 256,
               "max_model_len": 256, **kwargs}
    llm = LLM(str(model_dir), backend=backend, dtype="float32", speculative_config=speculative, **options)
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def _check_greedy_parity(model_dir: Path, backend: str, count: int, num_kv_blocks: int = 96,
                         speculative: dict | None = None) -> None:
    requests = _requests(count)
    plain, _ = _generate(model_dir, backend, requests, num_kv_blocks=num_kv_blocks)
    spec, llm = _generate(model_dir, backend, requests, speculative or NGRAM, num_kv_blocks=num_kv_blocks)
    stats = llm.engine.speculator.stats
    assert llm.engine.scheduler.num_preemptions > 0, "the cache is meant to be too small: nothing was preempted"
    assert stats.num_accepted > count // 4, f"too few drafts accepted to prove anything: {stats}"
    assert stats.num_drafted > stats.num_accepted, f"every draft was accepted, so rejection was never tested: {stats}"
    assert spec == plain


@pytest.mark.parametrize(("preset", "backend", "count", "blocks"), [("llama", "cpu", 48, 96), ("qwen2", "cpu", 48, 96),
                                                                    ("llama", "reference", 16, 32),
                                                                    ("mixtral", "cpu", 24, 64),
                                                                    ("qwen2_moe", "reference", 12, 32)])
def test_ngram_greedy_tokens_equal_plain_decoding_under_preemption(model_dirs, preset: str, backend: str,
                                                                   count: int, blocks: int) -> None:
    _check_greedy_parity(model_dirs[preset], backend, count, blocks)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("preset", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_ngram_greedy_parity_over_200_requests(model_dirs, preset: str, backend: str) -> None:
    _check_greedy_parity(model_dirs[preset], backend, 200)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("preset", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("proposer", ["draft_model", "eagle", "eagle3"])
def test_loaded_drafters_greedy_parity_over_200_requests(tmp_path: Path, preset: str, backend: str,
                                                         proposer: str) -> None:
    """The same 200 requests with a draft model (the target quantized to int8 weights: it agrees often, not
    always) and with an EAGLE-1 or EAGLE-3 head (a predictable one over a predictable target; untied, since a
    nearly bigram model with tied embeddings repeats its token forever and every draft would be accepted; 8
    layers for EAGLE-3, whose default taps are three different layers from 6 on)."""
    untied = {"tie_word_embeddings": False} if proposer != "draft_model" else {}
    if proposer == "eagle3":
        untied["num_hidden_layers"] = 8
    target = build_tiny_model(tmp_path / "target", preset, seed=3, tokenizer=False, **untied)
    if proposer != "draft_model":
        build = build_eagle_head if proposer == "eagle" else build_eagle3_head
        head = build(tmp_path / "head", target, seed=6, predictable=0.03)
        config = {"method": proposer, "model": str(head), "num_speculative_tokens": 3, "min_acceptance": 0.0}
    else:
        config = {"method": "draft_model", "model": str(target), "quant_type": "weight_only_int8",
                  "num_speculative_tokens": 3}
    _check_greedy_parity(target, backend, 200, speculative=config)


def test_stops_and_max_tokens_inside_an_accepted_run(model_dirs) -> None:
    """A stop token or max_tokens that falls inside a round's accepted drafts ends the output exactly where
    plain decoding ends it, and the tokens after it are never reported."""
    model_dir = model_dirs["llama"]
    requests = _requests(12, seed=5)
    plain, _ = _generate(model_dir, "cpu", [(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                                            for p, _ in requests])
    stopped = []
    for (prompt, _), tokens in zip(requests, plain, strict=True):
        stop = tokens[len(tokens) // 2]
        stopped.append((prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])))
    truncated = [tokens[:tokens.index(stop.stop_token_ids[0]) + 1] for tokens, (_, stop) in zip(plain, stopped,
                                                                                                  strict=True)]
    spec, llm = _generate(model_dir, "cpu", stopped, NGRAM)
    assert spec == truncated
    capped = [(p, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)) for p, _ in requests]
    spec, llm = _generate(model_dir, "cpu", capped, NGRAM)
    assert spec == [tokens[:7] for tokens in plain]
    assert llm.engine.speculator.stats.num_accepted > 0


def test_logprobs_of_accepted_tokens_are_the_targets(model_dirs) -> None:
    requests = [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3, repetition_penalty=1.2))
                for p, _ in _requests(8, seed=2)]
    llm_plain = LLM(str(model_dirs["qwen2"]), backend="cpu", dtype="float32", block_size=BLOCK)
    llm_spec = LLM(str(model_dirs["qwen2"]), backend="cpu", dtype="float32", block_size=BLOCK, speculative_config=NGRAM)
    plain = llm_plain.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    spec = llm_spec.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert llm_spec.engine.speculator.stats.num_accepted > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-5)
        for top_a, top_b in zip(a.outputs[0].top_logprobs, b.outputs[0].top_logprobs, strict=True):
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert [v for _, v in top_a] == pytest.approx([v for _, v in top_b], abs=1e-5)


def test_seeded_sampling_does_not_depend_on_the_batch(model_dirs) -> None:
    """With speculation on, a seeded request gets the same tokens alone and among other requests (greedy,
    sampled, with and without drafts), since its draws come only from its own generator."""
    model_dir = model_dirs["llama"]
    prompt = _requests(3, seed=9)[2][0]
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=1234, ignore_eos=True,
                            frequency_penalty=0.3)
    alone, llm = _generate(model_dir, "cpu", [(prompt, params)], NGRAM)
    others = _requests(7, seed=11)
    others[3] = (others[3][0], SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True))
    crowded, llm = _generate(model_dir, "cpu", [*others[:4], (prompt, params), *others[4:]], NGRAM)
    assert crowded[4] == alone[0]
    assert llm.engine.speculator.stats.num_drafted > 0


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_seeded_sampled_tokens_equal_plain_decoding(model_dirs, backend: str) -> None:
    """Seeded sampled requests emit the tokens they emit without speculation, whatever the guard decides (here
    told to pause at once or never), since a draw's noise depends only on the seed and the position."""
    model_dir = model_dirs["qwen2"]
    requests = [(prompt, SamplingParams(max_tokens=24, temperature=t, top_p=0.95, seed=100 + i, ignore_eos=True,
                                        frequency_penalty=0.2))
                for i, ((prompt, _), t) in enumerate(zip(_requests(10, seed=21), [0.3, 0.6] * 5, strict=True))]
    plain, _ = _generate(model_dir, backend, requests)
    for guard in (0.0, 0.9):
        spec, llm = _generate(model_dir, backend, requests, {**NGRAM, "min_acceptance": guard})
        stats = llm.engine.speculator.stats
        assert stats.num_accepted > 0 and stats.num_drafted > stats.num_accepted, stats
        assert spec == plain


@pytest.mark.parametrize("config", [{"method": "ngram", "num_speculative_tokens": 0},
                                    {"method": "ngram", "num_speculative_tokens": 100},
                                    {"method": "medusa"},
                                    {"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}])
def test_bad_speculative_configs_are_refused_before_anything_runs(model_dirs, config) -> None:
    with pytest.raises(ValueError) as info:
        LLM(str(model_dirs["llama"]), backend="cpu", speculative_config=config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config", [{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 0},
                                    {"method": "eagle", "model": "DRAFT", "num_speculative_tokens": 100},
                                    {"method": "mtp", "num_speculative_tokens": 9}])
def test_bad_draft_counts_are_refused_before_any_model_loads(tmp_path: Path, config) -> None:
    """The draft count is checked before the target (here: a directory that does not exist) or a draft loads."""
    with pytest.raises(ValueError, match=r"in 1\.\.8, got") as info:
        LLM(str(tmp_path / "no-model"), backend="cpu", speculative_config=config)
    assert "\n" not in str(info.value)


def test_draft_model_greedy_tokens_equal_plain_decoding(model_dirs, tmp_path_factory) -> None:
    """A draft model (here: another random model of the same vocabulary, and the target itself) changes
    how many tokens a round yields, never which; the target as its own draft accepts nearly everything."""
    requests = _requests(32, seed=4)
    target = model_dirs["llama"]
    plain, _ = _generate(target, "cpu", requests, num_kv_blocks=40)
    other = build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=8, tokenizer=False)
    for draft, least_acceptance in ((other, 0.0), (target, 0.95)):
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        spec, llm = _generate(target, "cpu", requests, config, num_kv_blocks=40)
        stats = llm.engine.speculator.stats
        assert llm.engine.scheduler.num_preemptions > 0
        assert spec == plain
        assert stats.num_drafted > 0 and stats.acceptance_rate >= least_acceptance, stats


def test_a_draft_model_decodes_its_steps_in_native_multi_step_calls(model_dirs, monkeypatch) -> None:
    """On the cpu backend the draft's k - 1 steps after its catch-up pass run as one multi-step call, and
    what they draft is what single steps draft: the target as its own draft is accepted nearly always. (Without
    the lookup's passes, which would take the steps whose tokens it guesses.)"""
    from flashllm.backends.cpu.runner import CpuRunner

    bursts: list[tuple[CpuRunner, int]] = []
    execute_burst = CpuRunner.execute_burst

    def counting(self, batch, states, steps):
        rows = execute_burst(self, batch, states, steps)
        if rows is not None:
            bursts.append((self, len(rows)))
        return rows

    monkeypatch.setattr(CpuRunner, "execute_burst", counting)
    requests = _requests(12, seed=6)
    target = model_dirs["llama"]
    plain, _ = _generate(target, "cpu", requests)
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4, "draft_lookup": False}
    spec, llm = _generate(target, "cpu", requests, config)
    assert spec == plain
    assert llm.engine.speculator.stats.acceptance_rate >= 0.95, llm.engine.speculator.stats
    drafts = [steps for runner, steps in bursts if runner is llm.engine.speculator.proposer.runner]
    assert drafts and max(drafts) == 3, f"the draft ran no 3-step call: {drafts}"


def test_a_draft_models_catch_up_runs_as_one_token_rows_in_the_fused_step(model_dirs, monkeypatch) -> None:
    """After its first pass over the prompt, the draft catches up on a round's accepted tokens as one-token rows
    (the verify step's shape), which the cpu backend's fused decode step takes instead of the layer-by-layer
    forward; its drafts stay the target's own (the target as its own draft is accepted nearly always)."""
    from flashllm.backends.cpu.runner import CpuRunner
    from flashllm.core.model_runner import ModelRunner

    calls: list[tuple[ModelRunner, int, int, bool]] = []  # (runner, rows, longest query, fell back)
    fused_forward, layer_forward = CpuRunner._forward, ModelRunner._forward

    def recording(self, inputs):
        calls.append((self, int(inputs.input_ids.numel()), int(inputs.attn_metadata.max_seqlen_q), False))
        return fused_forward(self, inputs)

    def fallback(self, inputs):
        runner, rows, query, _ = calls[-1]
        calls[-1] = (runner, rows, query, True)
        return layer_forward(self, inputs)

    monkeypatch.setattr(CpuRunner, "_forward", recording)
    monkeypatch.setattr(ModelRunner, "_forward", fallback)
    requests = _requests(6, seed=12)
    target = model_dirs["llama"]
    plain, _ = _generate(target, "cpu", requests)
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    spec, llm = _generate(target, "cpu", requests, config)
    assert spec == plain
    assert llm.engine.speculator.stats.acceptance_rate >= 0.95, llm.engine.speculator.stats
    draft = llm.engine.speculator.proposer.runner
    rows = [(n, fell_back) for runner, n, query, fell_back in calls if runner is draft and query == 1 and n > 1]
    assert rows, "the draft ran no catch-up as one-token rows"
    assert not any(fell_back for _, fell_back in rows), f"catch-up rows left the fused step: {rows}"


def test_a_group_wise_int4_draft_model_drafts_and_changes_no_token(model_dirs) -> None:
    """--speculative_weightonly_group_size: the draft's linear layers hold one int4 scale per group of input
    features (the target stays float), and the tokens are plain decoding's."""
    from flashllm.models.layers.linear import LinearBase

    requests = _requests(12, seed=13)
    target = model_dirs["qwen2"]
    plain, _ = _generate(target, "cpu", requests)
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
              "quant_type": "weight_only_int4", "group_size": 32}
    spec, llm = _generate(target, "cpu", requests, config)
    assert spec == plain
    assert llm.engine.speculator.stats.num_accepted > 0, llm.engine.speculator.stats
    draft = [m for m in llm.engine.speculator.proposer.runner.model.modules() if isinstance(m, LinearBase)]
    assert draft and all(m.qweight.scheme == "w4a16" and m.qweight.group_size == 32 for m in draft)
    assert all(m.qweight.scheme == "none" for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase))


def test_a_draft_model_with_another_vocabulary_is_refused(model_dirs, tmp_path_factory) -> None:
    other = build_tiny_model(tmp_path_factory.mktemp("other-vocab"), "llama", seed=8, tokenizer=False, vocab_size=300)
    with pytest.raises(ValueError, match="vocab") as info:
        LLM(str(model_dirs["llama"]), backend="cpu", speculative_config={"model": str(other)})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="--speculative-model"):
        LLM(str(model_dirs["llama"]), backend="cpu", speculative_config={"method": "draft_model"})


def test_a_draft_models_prompt_pass_runs_in_the_prefill_steps(model_dirs, monkeypatch) -> None:
    """The draft runs each prefill chunk the target runs, in the same engine step (so its prompt pass is timed as
    prefill): its rounds then catch up on a few tokens (a round's accepted drafts and the target's token, or a
    short burst's), never on a prompt of over 40 tokens, chunked prompts included; the tokens stay plain
    decoding's."""
    from flashllm.core.spec.draft_model import DraftModelProposer

    catch_ups: list[int] = []
    catch_up = DraftModelProposer._catch_up

    def recording(self, views, guesses):
        catch_ups.extend(len(v.token_ids) - v.num_computed_tokens for v in views)
        return catch_up(self, views, guesses)

    monkeypatch.setattr(DraftModelProposer, "_catch_up", recording)
    requests = [(p, s) for p, s in _requests(12, seed=15) if len(p) > 40 and s.max_tokens > 1]
    target = model_dirs["llama"]
    # one sequence at a time (no decode waits for a budget other prompts take), no preemption, prompts in chunks
    options = {"num_kv_blocks": 200, "max_num_batched_tokens": 32, "max_num_seqs": 1}
    plain, _ = _generate(target, "cpu", requests, **options)
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    spec, llm = _generate(target, "cpu", requests, config, **options)
    assert spec == plain
    assert llm.engine.scheduler.num_preemptions == 0
    assert len(requests) >= 3 and catch_ups, "no prompt long enough to chunk, or nothing drafted"
    # a round catches up on its accepted drafts and the model's token, or on a short burst after a miss
    assert max(catch_ups) <= 1 + MAX_DRAFT_TOKENS, f"a round caught the draft up on a prompt: {sorted(catch_ups)[-5:]}"
