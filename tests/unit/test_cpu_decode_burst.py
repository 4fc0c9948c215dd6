"""The cpu backend's greedy decode bursts (decode_burst.py, Engine._burst) against single steps.

A burst runs several greedy decode steps in one native call and the engine records them one by
one, so every output (tokens, finish reasons, text cut at stop strings) must equal what the same
engine gives one step a round (num_scheduler_steps=1); and bursts must actually run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.backends.cpu import decode_burst, greedy_screen, native
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.greedy_rows import greedy_screen_rows
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63)), [9]]
MAX_TOKENS = [24, 9, 30, 17, 5]  # sequences leave the batch at different steps, inside bursts too


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # GQA; qkv bias with tied embeddings
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=7)


def _llm(model_dir: Path, steps: int, **kwargs) -> LLM:
    # batches the screen takes, so every burst runs
    options = dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=40, max_model_len=128,
                   max_num_seqs=greedy_screen_rows())
    return LLM(str(model_dir), num_scheduler_steps=steps, **{**options, **kwargs})


def _bursts(monkeypatch: pytest.MonkeyPatch, sizes: list[int] | None = None) -> list[int]:
    """The steps each burst call returned, appended as they run (0: the call declined); `sizes` gets
    each call's number of sequences."""
    runs: list[int] = []
    real = decode_burst.GreedyBurst.__call__

    def counting(self, input_ids, *args, **kwargs):
        rows = real(self, input_ids, *args, **kwargs)
        runs.append(0 if rows is None else len(rows))
        if sizes is not None:
            sizes.append(input_ids.numel())
        return rows

    monkeypatch.setattr(decode_burst.GreedyBurst, "__call__", counting)
    return runs


def _outputs(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("quant", [{}, {"quant_type": "w8a16"}])
def test_bursts_give_what_single_steps_give(model_dir, monkeypatch, quant) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    single = _outputs(_llm(model_dir, 1, **quant), PROMPTS, params)
    runs = _bursts(monkeypatch)
    llm = _llm(model_dir, 8, **quant)
    assert _outputs(llm, PROMPTS, params) == single
    assert max(runs) == 8 and 0 not in runs  # full bursts ran, and none was declined
    # a long one alone crosses block boundaries inside bursts; its blocks all come back at the end
    long = [SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)]
    assert _outputs(llm, [[3, 4, 5]], long) == _outputs(_llm(model_dir, 1, **quant), [[3, 4, 5]], long)
    assert llm.engine.num_free_blocks() == 40


def test_bursts_while_requests_wait_for_a_seat(model_dir, monkeypatch) -> None:
    """With every seat taken, a burst runs while others wait, and ends where a sequence's max_tokens
    frees its seat: the waiting ones join as they would have, and outputs are unchanged."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    single = _outputs(_llm(model_dir, 1, max_num_seqs=2), PROMPTS, params)
    runs = _bursts(monkeypatch)
    llm = _llm(model_dir, 8, max_num_seqs=2)
    waiting: list[int] = []
    real = llm.engine.runner.execute_burst

    def watching(*args):
        waiting.append(llm.engine.scheduler.num_waiting)
        return real(*args)

    llm.engine.runner.execute_burst = watching
    assert _outputs(llm, PROMPTS, params) == single
    assert max(waiting) > 0 and 0 not in runs


def test_stops_inside_a_burst(model_dir, monkeypatch) -> None:
    """A stop token ends the burst at its step; a stop string, max_model_len and max_tokens end the
    sequence where single steps end it (tokens the burst ran past them are dropped)."""
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ((tokens, text, _),) = _outputs(_llm(model_dir, 1), [[11, 12, 13]], [plain])
    # a token first seen inside a burst (bursts bring tokens 1-8, 9-16, ...: not at a burst's end)
    stop_token = next(t for i, t in enumerate(tokens) if i >= 11 and i % 8 and t not in tokens[:i])
    stop_text = text[len(text) // 3 : len(text) // 3 + 3]
    cases = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token]),
             SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop_text]),
             SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)]
    prompts = [[11, 12, 13]] * len(cases)
    single = _outputs(_llm(model_dir, 1), prompts, cases)
    assert [reason for *_, reason in single] == ["stop", "stop", "length"]
    runs = _bursts(monkeypatch)
    assert _outputs(_llm(model_dir, 8), prompts[:1], cases[:1]) == single[:1]
    # the prefill's token, then bursts of 8 up to the stop token's step, where its burst ends
    assert runs[:-1] == [8] * (len(runs) - 1) and sum(runs) == tokens.index(stop_token)
    assert _outputs(_llm(model_dir, 8), prompts, cases) == single
    short = _llm(model_dir, 8, max_model_len=32)  # 3 prompt tokens: 29 more, then length
    assert _outputs(short, [[11, 12, 13]], [plain]) == _outputs(_llm(model_dir, 1, max_model_len=32),
                                                                [[11, 12, 13]], [plain])


def test_prefix_cache_hits_and_sampling_rows_keep_single_steps(model_dir, monkeypatch) -> None:
    """A prompt computed before (cache hits) decodes as before; a sampled request in the batch, or a
    penalty, keeps the batch on single steps."""
    runs = _bursts(monkeypatch)
    llm = _llm(model_dir, 8)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = list(range(40, 80))  # two full blocks of 16 to hit
    first = _outputs(llm, [prompt], [greedy])
    assert _outputs(llm, [prompt], [greedy]) == first
    assert llm.engine.block_manager.prefix_cache_hit_rate > 0
    assert first == _outputs(_llm(model_dir, 1), [prompt], [greedy])
    runs.clear()
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    penalised = SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=0.5, ignore_eos=True)
    _outputs(llm, [prompt, [1, 2, 3]], [greedy, sampled])
    _outputs(llm, [prompt], [penalised])
    assert runs == []


def test_a_token_the_screen_cannot_settle_ends_the_burst(model_dir, monkeypatch) -> None:
    """A row of the head's copy made NaN leaves every step's pick unsure: each burst stops after its
    first step and that token comes from the full fp32 logits, as in a single step."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    single = _outputs(_llm(model_dir, 1), PROMPTS, params)
    runs = _bursts(monkeypatch)
    llm = _llm(model_dir, 8)
    screen = greedy_screen.kept(llm.engine.runner.model)
    if screen.kind == "int8":
        screen.scales[7] = float("nan")
    else:
        screen.screen[7] = 0x7FC0  # a bf16 NaN
    assert _outputs(llm, PROMPTS, params) == single
    assert runs and set(runs) == {1}


def test_a_batch_the_screen_does_not_take_runs_single_steps(model_dir, monkeypatch) -> None:
    """With its tiles off, an AVX2 CPU's bf16 screen takes at most 2 tokens: larger decode batches
    are declined before their inputs are built, and bursts start once 2 sequences are left."""
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "bf16")
    lib = native.library()
    best, tiles = lib.flashllm_screen_set_path(-1), lib.flashllm_screen_set_avx2_tiles(-1)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    try:
        lib.flashllm_screen_set_path(0)  # the AVX2 loops
        lib.flashllm_screen_set_avx2_tiles(0)  # rows only
        single = _outputs(_llm(model_dir, 1), PROMPTS, params)
        sizes: list[int] = []
        runs = _bursts(monkeypatch, sizes)
        assert _outputs(_llm(model_dir, 8, max_num_seqs=len(PROMPTS)), PROMPTS, params) == single
    finally:
        lib.flashllm_screen_set_path(best)
        lib.flashllm_screen_set_avx2_tiles(tiles)
    assert sizes and max(sizes) == 2 and 0 not in runs


def test_a_burst_stops_where_the_block_tables_end(model_dir) -> None:
    """Tables grown for fewer steps than asked: the burst ends at the last position they cover,
    rather than reading past them, and its tokens are the steps it ran."""
    llm = _llm(model_dir, 1)
    runner = llm.engine.runner
    burst = decode_burst.build(runner.model, runner.argmax)
    assert burst is not None
    from flashllm.ops.attention_metadata import AttentionMetadata

    def metadata() -> AttentionMetadata:  # one sequence at position 13 of block 2 (of 1 block's table)
        return AttentionMetadata(slot_mapping=torch.tensor([2 * 16 + 13]), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                                 seq_lens=torch.tensor([14], dtype=torch.int32),
                                 block_tables=torch.tensor([[2]], dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=14)

    with torch.inference_mode():
        rows = burst(torch.tensor([5]), torch.tensor([13]), runner.kv_caches, metadata(), 8, ())
        assert rows is not None and len(rows) == 3  # positions 13, 14, 15: the block's last
        again = burst(torch.tensor([5]), torch.tensor([13]), runner.kv_caches, metadata(), 2, ())
        assert again == rows[:2]
        md = metadata()
        md.slot_mapping[0] = 40 * 16  # past the caches: refused before anything runs
        assert burst(torch.tensor([5]), torch.tensor([13]), runner.kv_caches, md, 8, ()) is None
