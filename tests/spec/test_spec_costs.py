"""The break-even acceptance of drafts that cost passes (a draft model, EAGLE heads): the round costs the engine
measures at start-up (core/spec/costs.py), the formula, and the guard judging a sequence against that point
instead of the fixed quarter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flashllm.core.spec import costs as spec_costs
from flashllm.core.spec import speculator as spec
from flashllm.core.spec.costs import RoundCosts
from flashllm.llm import LLM
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.tiny_models import build_tiny_model

OPTIONS = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 2, "max_model_len": 256, "dtype": "float32"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=4, tokenizer=False)


@pytest.mark.parametrize("draft, verify", [(16.0, 14.0), (2.0, 11.0), (40.0, 30.0)])
def test_at_the_break_even_acceptance_a_round_costs_what_its_tokens_cost_plainly(draft: float, verify: float) -> None:
    costs = RoundCosts(drafts=4, decode_step=12.0, decode_token=10.0, verify=verify, draft=draft)
    rate = costs.break_even()
    tokens = 1 + rate * costs.drafts  # what a round yields at that acceptance
    assert math.isclose((costs.draft + costs.verify) / tokens, costs.decode_token)
    # a better acceptance makes a round cheaper per token than plain decoding, a worse one dearer
    assert (costs.draft + costs.verify) / (tokens + 0.1) < costs.decode_token < (costs.draft + costs.verify) / (tokens - 0.1)
    assert costs.verify_step_cost == verify / 12.0


@pytest.fixture(scope="module")
def headed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An 8-layer target (the default EAGLE-3 taps are three layers from 6 on) with an EAGLE and an EAGLE-3 head."""
    mk = tmp_path_factory.mktemp
    target = build_tiny_model(mk("target8"), "llama", seed=5, tokenizer=False, num_hidden_layers=8)
    return {"target": target, "eagle": build_eagle_head(mk("eagle"), target, seed=1),
            "eagle3": build_eagle3_head(mk("eagle3"), target, seed=2)}


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_the_engine_measures_a_drafting_models_round_on_blocks_it_gives_back(
        method: str, target: Path, headed: dict[str, Path], monkeypatch) -> None:
    measured: list[RoundCosts | None] = []
    measure = spec_costs.measure_round

    def recording(engine, drafts, **options):
        costs = measure(engine, drafts, **options)
        measured.append(costs)
        return costs

    monkeypatch.setattr(spec_costs, "measure_round", recording)
    if method != "draft_model":
        target = headed["target"]
    config = {"method": method, "model": str(headed.get(method, target)), "num_speculative_tokens": 3}
    llm = LLM(str(target), backend="cpu", speculative_config=config, **OPTIONS)
    engine = llm.engine
    assert len(measured) == 1 and measured[0] is not None
    costs = measured[0]
    assert costs.drafts == 3 and min(costs.decode_step, costs.decode_token, costs.verify, costs.draft) > 0
    expected = min(max(spec._DEFAULT_MIN_ACCEPTANCE, costs.break_even()), spec._MAX_MIN_ACCEPTANCE)
    assert math.isclose(engine.speculator.min_acceptance, expected)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    proposer = engine.speculator.proposer
    kept = getattr(proposer, "_states", None) if method == "draft_model" else proposer._pending
    assert not kept, "the measurement left the proposer's state behind"
    assert spec_costs.measure_round(engine, 3) is not None  # the bench's: the verify step alone
    assert not kept, "the verify-only measurement left the proposer's state behind"
    # and the engine still decodes after it
    assert len(llm.generate([[5, 6, 7, 8]], use_tqdm=False)[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("config", [{"method": "ngram"}, {"method": "draft_model", "min_acceptance": 0.3}])
def test_nothing_is_measured_for_free_drafts_or_a_given_threshold(target: Path, monkeypatch, config: dict) -> None:
    monkeypatch.setattr(spec_costs, "measure_round", lambda *a, **k: pytest.fail("a round was measured"))
    if config["method"] == "draft_model":
        config = {**config, "model": str(target)}
    llm = LLM(str(target), backend="cpu", speculative_config=config, **OPTIONS)
    assert llm.engine.speculator.min_acceptance == config.get("min_acceptance", spec._DEFAULT_MIN_ACCEPTANCE)


def test_no_room_for_the_measuring_sequence_keeps_the_default(target: Path) -> None:
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    llm = LLM(str(target), backend="cpu", speculative_config=config, **OPTIONS)
    engine = llm.engine
    taken = [engine.block_manager._allocate_block() for _ in range(engine.block_manager.num_free_blocks)]
    assert taken and spec_costs.measure_round(engine, 3, proposer=engine.speculator.proposer) is None
