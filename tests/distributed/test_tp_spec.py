"""Speculation under tensor parallelism (gloo, two `mp` ranks): the drafter runs whole on the driver beside its
shard of the target. A draft model gives plain one-rank greedy tokens; heads that read the target's hidden states
(EAGLE-1, EAGLE-3, DeepSeek's MTP layer), with whole copies of the target's embedding and LM head gathered to
the driver, draft what they draft on one rank, and greedy tokens stay plain one-rank decoding's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flashllm import LLM, SamplingParams
from flashllm.models.layers import embedding
from flashllm.testing.deepseek import build_deepseek_mtp_model
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.spec_engine import record_drafts
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
        drafts = record_drafts(llm) if speculative is not None else []
        outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        stats = llm.engine.speculator.stats if llm.engine.speculator is not None else None
        launcher = getattr(llm.engine.executor, "_launcher", None)
        workers = len(launcher.procs) if launcher is not None else 0
        return [list(o.outputs[0].token_ids) for o in outputs], {"stats": stats, "workers": workers, "drafts": drafts}
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


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(target, head) per method: heads that guess right often ("predictable"), so that rounds accept drafts;
    the EAGLE-1 head uses the target's embedding and LM head, the EAGLE-3 head its embedding."""
    mk = tmp_path_factory.mktemp
    llama1 = build_tiny_model(mk("llama1"), "llama", seed=3, tokenizer=False, num_hidden_layers=8)
    llama3 = build_tiny_model(mk("llama3"), "llama", seed=3, tokenizer=False, num_hidden_layers=8)
    deepseek = build_deepseek_mtp_model(mk("deepseek"), "v3", seed=5, predictable=0.03)
    return {"eagle": (llama1, build_eagle_head(mk("eagle"), llama1, seed=6, predictable=0.03)),
            "eagle3": (llama3, build_eagle3_head(mk("eagle3"), llama3, seed=6, predictable=0.03)),
            "mtp": (deepseek, deepseek)}


@pytest.mark.parametrize(("method", "gathered"), [("eagle", [(True, True)]), ("eagle3", [(True, False)]),
                                                  ("mtp", [])])
def test_a_head_on_the_driver_drafts_what_it_drafts_on_one_rank(head_dirs, monkeypatch, method: str,
                                                               gathered: list) -> None:
    """gathered: the (embedding, LM head) copies the driver asked for: an EAGLE-1 head reads both of the target's,
    this EAGLE-3 head the embedding (its LM head is its own), this MTP layer neither (it has copies of both)."""
    asked: list[tuple[bool, bool]] = []
    gather = embedding.gather_whole_vocabulary

    def spy(embed, head, ops, wanted=(True, True)):
        asked.append(wanted)
        return gather(embed, head, ops, wanted)

    monkeypatch.setattr(embedding, "gather_whole_vocabulary", spy)
    target, head = head_dirs[method]
    requests = _requests(12)
    config = {"method": method, "num_speculative_tokens": 3, "min_acceptance": 0.0}
    if method != "mtp":
        config["model"] = str(head)
    plain, _ = _generate(target, 1, requests)
    one, one_info = _generate(target, 1, requests, config)
    two, info = _generate(target, 2, requests, config)
    assert info["workers"] == 1  # the target's second shard ran in its own process
    assert one == plain and two == plain
    stats = info["stats"]
    # short answers: a head's first round of a sequence has nothing to draft from; a random head scores ~1/256
    assert stats.num_drafted > 0 and stats.acceptance_rate > 0.2, stats
    # the same sequences, the same drafts: the head read the same hidden states and vocabulary on the driver
    assert info["drafts"] == one_info["drafts"]
    assert asked == gathered
