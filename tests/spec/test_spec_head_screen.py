"""A speculative head's greedy drafts through the cpu backend's screened LM head (backends/cpu/greedy_screen.py,
ModelRunner.greedy_head): the screen reads an int8 or bf16 copy of the head instead of computing its fp32 logits,
and every round's drafts equal those from the logits (FLASHLLM_CPU_GREEDY_SCREEN=0), for an EAGLE-1 head (the
target's LM head, whose screen it shares), an EAGLE-3 head (its own norm and head over a draft vocabulary) and
DeepSeek's MTP layer (shared_head's norm, then its own head)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashllm.backends.cpu import greedy_screen
from flashllm.config import SpeculativeConfig
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import build_deepseek_mtp_model
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.spec_engine import random_prompts, record_drafts, spec_llm
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not greedy_screen.native.library(), reason="the cpu backend's native library "
                                "did not build here: no screened head")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, SpeculativeConfig]]:
    """(target, config) per method, each head predictable so that drafts run past the first."""
    mk = tmp_path_factory.mktemp
    llama1 = build_tiny_model(mk("llama1"), "llama", seed=3, tokenizer=False, num_hidden_layers=8)
    llama3 = build_tiny_model(mk("llama3"), "llama", seed=3, tokenizer=False, num_hidden_layers=8)
    deepseek = build_deepseek_mtp_model(mk("deepseek"), "v3", seed=5, predictable=0.03)

    def config(method: str, head: Path | None) -> SpeculativeConfig:
        return SpeculativeConfig(method=method, model=str(head) if head else None, num_speculative_tokens=3,
                                 min_acceptance=0.0)

    return {"eagle": (llama1, config("eagle", build_eagle_head(mk("eagle"), llama1, seed=6, predictable=0.03))),
            "eagle3": (llama3, config("eagle3", build_eagle3_head(mk("eagle3"), llama3, seed=6, predictable=0.03))),
            "mtp": (deepseek, config("mtp", None))}


def _drafts(target: Path, config: SpeculativeConfig) -> tuple[list[list[int]], object]:
    """Every round's drafts over 4 prompts, and the engine."""
    llm = spec_llm(target, "cpu", config)
    calls = record_drafts(llm)
    prompts = random_prompts(4, seed=8)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [drafts for _, _, drafts in calls], llm.engine


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_screened_drafts_equal_the_drafts_from_logits(dirs, monkeypatch, method: str) -> None:
    target, config = dirs[method]
    screened, engine = _drafts(target, config)
    screen = engine.speculator.proposer._screened
    assert isinstance(screen, greedy_screen.GreedyScreen) and screen.picked >= sum(map(len, screened)), screen
    # an EAGLE-1 head reads the target's own LM head: one screen for the target's greedy steps and the head's
    assert (screen is greedy_screen.kept(engine.runner.model)) == (method == "eagle")
    monkeypatch.setenv(greedy_screen.ENV_SWITCH, "0")
    from_logits, plain = _drafts(target, config)
    assert plain.speculator.proposer._screened is None
    assert screened == from_logits and sum(map(len, screened)) > 30
