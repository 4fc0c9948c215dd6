"""Draft-model speculation under tensor parallelism (gloo, two `mp` ranks): the draft runs whole on the driver beside
its shard of the target, and greedy tokens equal plain one-rank decoding; heads that read the target's hidden
states (EAGLE, MTP) are still refused there, in one line, before anything starts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flashllm import LLM, SamplingParams
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"target": build_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=3, tokenizer=False),
            "other": build_tiny_model(tmp_path_factory.mktemp("other"), "llama", seed=8, tokenizer=False)}


def _requests(count: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 3..60 tokens, most repeating a span of themselves, and 4..24 greedy tokens each."""
    rng = random.Random(5)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 40))]
        prompt += prompt[: rng.randrange(0, 20)]
        out.append((prompt, SamplingParams(max_tokens=rng.randrange(4, 25), temperature=0.0, ignore_eos=True)))
    return out


def _generate(model_dir: Path, tp: int, requests, speculative: dict | None = None) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None, block_size=16, num_kv_blocks=48,
              max_num_batched_tokens=64, speculative_config=speculative)
    try:
        outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        stats = llm.engine.speculator.stats if llm.engine.speculator is not None else None
        launcher = getattr(llm.engine.executor, "_launcher", None)
        workers = len(launcher.procs) if launcher is not None else 0
        return [list(o.outputs[0].token_ids) for o in outputs], {"stats": stats, "workers": workers}
    finally:
        llm.engine.shutdown()


def test_a_draft_model_on_the_driver_gives_plain_one_rank_tokens(dirs: dict[str, Path]) -> None:
    requests = _requests(12)
    plain, _ = _generate(dirs["target"], 1, requests)
    for draft, least_acceptance in ((dirs["other"], 0.0), (dirs["target"], 0.9)):
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        spec, info = _generate(dirs["target"], 2, requests, config)
        stats = info["stats"]
        assert info["workers"] == 1  # the target's second shard ran in its own process
        assert spec == plain
        assert stats.num_drafted > 0 and stats.acceptance_rate >= least_acceptance, stats


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_heads_on_the_targets_hidden_states_are_refused_under_tensor_parallelism(dirs, method: str) -> None:
    config = {"method": method, "model": str(dirs["other"]), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="runs on one rank for now") as info:
        LLM(str(dirs["target"]), device="cpu", tensor_parallel_size=2, speculative_config=config)
    assert "\n" not in str(info.value)
