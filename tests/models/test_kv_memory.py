"""The cpu engine's KV memory follows its load: it grows with the sequences in flight, stays under
--kv-cache-memory, and goes back to the OS once the load ends (backends/cpu/kv_pages.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flashllm.backends.cpu import kv_pages
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.pages import backed_pages
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not kv_pages.enabled(), reason="lazily backed KV pages need Linux")

BLOCK = 32  # the tiny model's K (or V) block of one layer: 32 tokens x 2 heads x 16 x 4 B = one 4 KiB page
NUM_BLOCKS = 48
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=5, tokenizer=False)


def _requests(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(40, 70))] for _ in range(count)]


def _drive(llm: LLM, prompts: list[list[int]], measure) -> tuple[int, list[list[int]]]:
    """All prompts at once, greedy, 24 tokens each; (the largest measure() after any step, the tokens)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    peak, final = 0, {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output.outputs[0].token_ids
        peak = max(peak, measure())
    return peak, [list(final[i]) for i in ids]


def _llm(model_dir: Path, per_block: int | None = None) -> LLM:
    memory = None if per_block is None else NUM_BLOCKS * per_block
    return LLM(str(model_dir), backend="cpu", dtype="float32", block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=memory, num_kv_blocks=NUM_BLOCKS if memory is None else None, max_num_seqs=16)


def test_kv_memory_grows_with_load_stays_under_the_cap_and_returns(model_dir, monkeypatch):
    probe = _llm(model_dir)
    per_block = probe.engine.runner.kv_cache_bytes() // NUM_BLOCKS
    del probe
    cap = NUM_BLOCKS * per_block
    llm = _llm(model_dir, per_block)
    runner = llm.engine.runner
    caches = [t for layer in runner.kv_caches for t in layer]
    assert runner.kv_cache_bytes() <= cap

    def resident() -> int:
        return backed_pages(*caches)

    assert resident() == 0  # nothing written yet: a fresh engine holds no KV memory
    light, light_tokens = _drive(llm, _requests(1, seed=1), resident)
    after_light = resident()
    heavy, heavy_tokens = _drive(llm, _requests(10, seed=2), resident)
    after_heavy = resident()
    again, again_tokens = _drive(llm, _requests(10, seed=3), resident)  # released blocks are reused

    one_seq = -(-(70 + 24) // BLOCK) * per_block  # the longest request's blocks
    retained = -(-MAX_MODEL_LEN // BLOCK) * per_block  # the prefix cache kept after a load: one sequence's worth
    assert 0 < light <= one_seq
    assert heavy > 3 * light and again > 3 * light  # ten sequences in flight hold more than one
    assert max(light, heavy, again) <= cap
    assert after_light <= retained and after_heavy <= retained and resident() <= retained
    assert after_heavy < heavy / 3

    # the same requests on a cache allocated whole (zeroed, nothing released) give the same tokens
    monkeypatch.setenv(kv_pages.ENV_SWITCH, "0")
    whole = _llm(model_dir, per_block)
    assert not whole.engine.runner.releases_kv_memory
    assert _drive(whole, _requests(1, seed=1), int)[1] == light_tokens
    assert _drive(whole, _requests(10, seed=2), int)[1] == heavy_tokens
    assert _drive(whole, _requests(10, seed=3), int)[1] == again_tokens
