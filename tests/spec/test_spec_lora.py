"""Speculative decoding beside LoRA adapters: a batch mixing two adapters and base-model requests gets the tokens
it gets without speculation, greedy and seeded, with the n-gram lookup, a draft model (the base model, which knows
no adapter, so its drafts for adapter requests are often wrong) and an EAGLE head. Verify rows are ordinary
decode rows, so each carries its request's adapter; a verify step that ran them on the base model would give
the base model's tokens, which the adapters here change."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")

from flashllm.llm import LLM  # noqa: E402
from flashllm.lora import LoRARequest  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.eagle import build_eagle_head  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

TOKENS = 32
# prompts that repeat spans of themselves, so the lookup has drafts to offer
PROMPTS = [[5, 17, 3, 99, 42, 7, 1] * 3, [8, 9, 10, 11] * 5, [1, 2, 3, 1, 2, 3, 1, 2], list(range(30, 63)) * 2,
           [200, 13, 77, 13, 77, 13], [4, 40, 44, 4, 40, 44, 4, 40]]
CHOSEN = [0, None, 1, 0, 1, None]  # the adapter each prompt runs with (None: the base model)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[LoRARequest], Path]:
    root = tmp_path_factory.mktemp("spec-lora")
    base = build_tiny_model(root / "base", "llama", seed=5, tokenizer=False, tie_word_embeddings=False)
    loras = [LoRARequest(f"a{i}", i + 1, str(build_peft_adapter(base, root / f"a{i}", r=8, alpha=16, seed=40 + i)))
             for i in range(2)]
    head = build_eagle_head(root / "head", base, seed=6, predictable=0.03)
    return base, loras, head


def _generate(base: Path, loras: list[LoRARequest], params: list[SamplingParams], adapters: list[int | None],
              speculative: dict | None = None) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(base), backend="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=16, max_model_len=256, num_kv_blocks=96, speculative_config=speculative)
    chosen = [None if i is None else loras[i] for i in adapters]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=chosen)
    return [o.outputs[0].token_ids for o in outputs], llm


def _configs(base: Path, head: Path) -> dict[str, dict]:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3,
                            "min_acceptance": 0.0},
            "eagle": {"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "min_acceptance": 0.0}}


def test_the_adapters_change_the_tokens(setup) -> None:
    """The premise of the tests below: each adapter's greedy tokens differ from the base model's."""
    base, loras, _ = setup
    greedy = [SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    with_adapters, _ = _generate(base, loras, greedy, CHOSEN)
    without, _ = _generate(base, loras, greedy, [None] * len(PROMPTS))
    for i, adapter in enumerate(CHOSEN):
        assert (with_adapters[i] != without[i]) == (adapter is not None), i


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_greedy_tokens_with_adapters_equal_plain_decoding(setup, method: str) -> None:
    base, loras, head = setup
    greedy = [SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    plain, _ = _generate(base, loras, greedy, CHOSEN)
    spec, llm = _generate(base, loras, greedy, CHOSEN, _configs(base, head)[method])
    stats = llm.engine.speculator.stats
    assert stats.num_accepted > 0 and stats.num_drafted > stats.num_accepted, stats
    assert spec == plain


def test_seeded_sampled_tokens_with_adapters_equal_plain_decoding(setup) -> None:
    base, loras, head = setup
    sampled = [SamplingParams(max_tokens=TOKENS, temperature=0.8, top_k=20, seed=70 + i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    plain, _ = _generate(base, loras, sampled, CHOSEN)
    spec, llm = _generate(base, loras, sampled, CHOSEN, _configs(base, head)["ngram"])
    stats = llm.engine.speculator.stats
    assert stats.num_accepted > 0, stats
    assert spec == plain
