"""A draft model's greedy head over a subset of the vocabulary (--speculative_draft_vocab): the subset head's
tokens are the argmax over those ids of an independent float64 product, the engine's drafts are the restricted
greedy chain of transformers' own logits, and the tokens stay plain decoding's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from flashllm.backends.cpu import native
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.greedy_rows import greedy_screen_rows
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the cpu backend's native library")

BASE = 16  # ids below this are always in the draft's vocabulary here (the tiny models' vocabulary is 256)


def _oracle(weight: torch.Tensor, hidden: torch.Tensor, ids: list[int]) -> list[int]:
    """For each row, the id among `ids` whose head row scores highest in float64 (first on ties)."""
    scores = hidden.double() @ weight.double()[ids].T
    return [ids[int(i)] for i in scores.argmax(dim=1)]


def test_a_subset_head_picks_the_argmax_over_its_ids() -> None:
    from flashllm.backends.cpu.draft_vocab import GreedySubset
    from flashllm.backends.cpu.greedy_screen import GreedyScreen

    gen = torch.Generator().manual_seed(0)
    vocab, features = 700, 64
    weight = torch.randn(vocab, features, generator=gen)
    screen = GreedyScreen(weight, vocab, lambda rows: (rows @ weight.T).argmax(dim=1))
    subset = GreedySubset(screen)
    rng = random.Random(1)
    ids = rng.sample(range(vocab), 37)  # not a multiple of the row alignment, not sorted
    for step in range(3):
        subset.choose(ids)
        assert subset.chosen == ids and subset.vocab_size >= len(ids)
        hidden = torch.randn(min(3, greedy_screen_rows()), features, generator=gen) * 4
        got = subset(hidden)
        assert got is not None and got.tolist() == _oracle(weight, hidden, ids), f"step {step}"
        # the whole vocabulary's argmax is mostly elsewhere: the subset really restricts
        ids = ids + rng.sample(sorted(set(range(vocab)) - set(ids)), 50) if step == 0 else rng.sample(range(vocab), 20)
    with pytest.raises(ValueError, match="distinct"):
        subset.choose([3, 3])
    with pytest.raises(ValueError, match="distinct"):
        subset.choose([vocab])


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3, tokenizer=False)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(20, 60))]
        out.append(prompt + prompt[5:25])  # a span to repeat
    return out


def test_drafts_are_the_greedy_chain_over_the_draft_vocabulary(target: Path, monkeypatch) -> None:
    """Every round's drafts (the catch-up step's and the native burst's) equal the greedy chain of transformers'
    logits restricted to the ids below BASE and the tokens of the sequences drafted for so far; the tokens are plain
    decoding's."""
    from transformers import AutoModelForCausalLM

    from flashllm.core.spec.draft_model import DraftModelProposer

    rounds: list[tuple[list[int], list[int]]] = []
    propose = DraftModelProposer.propose

    def recording(self, seqs, limits):
        drafts = propose(self, seqs, limits)
        rounds.extend((list(seq.token_ids), list(d)) for seq, d in zip(seqs, drafts, strict=True))
        return drafts

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 1, "max_model_len": 256, "dtype": "float32"}
    plain = LLM(str(target), backend="cpu", **options).generate(prompts, params, use_tqdm=False)
    config = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4, "draft_vocab": BASE}
    llm = LLM(str(target), backend="cpu", speculative_config=config, **options)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    proposer = llm.engine.speculator.proposer
    assert proposer.restricted, "the cpu runner did not take the draft vocabulary"
    assert any(len(d) > 1 for _, d in rounds), "no round drafted several tokens (no burst was checked)"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    outside, seen = 0, set(range(BASE))
    with torch.no_grad():
        for tokens, drafts in rounds:  # the vocabulary keeps every token of the sequences drafted for so far
            seen |= set(tokens)
            allowed = sorted(seen)
            context = list(tokens)
            for draft in drafts:
                logits = model(torch.tensor([context])).logits[0, -1]
                assert draft == allowed[int(logits[allowed].argmax())], (len(tokens), drafts)
                outside += int(logits.argmax()) not in allowed
                context.append(draft)
    assert len(allowed) < vocab and outside > 0, "the whole vocabulary's argmax was always allowed: nothing restricted"


def test_the_draft_vocabulary_flag_is_checked_and_zero_keeps_the_whole_vocabulary(target: Path) -> None:
    with pytest.raises(ValueError, match="--speculative_draft_vocab"):
        LLM(str(target), backend="cpu", speculative_config={"model": str(target), "draft_vocab": -1})
    llm = LLM(str(target), backend="cpu", max_model_len=128, num_kv_blocks=16, block_size=16,
              speculative_config={"model": str(target), "draft_vocab": 0})
    assert not llm.engine.speculator.proposer.restricted
