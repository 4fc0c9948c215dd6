"""Speculative decoding in the engine on a real NVIDIA GPU: verify rows through the cuda backend's decode path
(graphs on and off), with each proposer, under preemption.

Skipped without a GPU (CI has none: there the Triton attention kernel is checked on verify-shaped batches under
TRITON_INTERPRET=1, tests/conformance/test_triton_interpret.py); run on a lent GPU with `python -m pytest tests/gpu`
or `benchmarks/gpu/run.sh spec`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# head size 64 (the smallest the Triton attention claims); 8 layers so EAGLE-3's default taps are distinct layers;
# untied, since a nearly bigram tiny model with tied embeddings repeats one token and accepts every draft
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
         "num_hidden_layers": 8, "tie_word_embeddings": False}
BLOCKS = 40  # too few for the batch: requests are preempted and come back


def _requests(count: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1..100 tokens, most repeating a span of themselves (the lookup's drafts), and 1..40 new tokens."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 100))]
        if len(prompt) > 4 and rng.random() < 0.7:
            start = rng.randrange(len(prompt) - 2)
            prompt += prompt[start:start + rng.randrange(2, 40)]
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=rng.randrange(1, 41), temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-spec")
    target = build_tiny_model(root / "target", "llama", seed=3, tokenizer=False, **SHAPE)
    return {"target": target, "eagle": build_eagle_head(root / "eagle", target, seed=6, predictable=0.03),
            "eagle3": build_eagle3_head(root / "eagle3", target, seed=6, predictable=0.03)}


def _config(dirs: dict[str, Path], method: str) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(dirs["target"]), "quant_type": "weight_only_int8",
                "num_speculative_tokens": 3}
    return {"method": method, "model": str(dirs[method]), "num_speculative_tokens": 3, "min_acceptance": 0.0}


def _generate(dirs: dict[str, Path], speculative: dict | None, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    prompts, params = _requests(48)
    options = {"device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": BLOCKS, "max_model_len": 256,
               "max_num_seqs": 16, "max_num_batched_tokens": 256, **kwargs}
    llm = LLM(str(dirs["target"]), speculative_config=speculative, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_greedy_tokens_equal_plain_decoding_on_the_gpu(dirs: dict[str, Path], method: str,
                                                       enforce_eager: bool) -> None:
    plain, _ = _generate(dirs, None, enforce_eager=enforce_eager)
    spec, llm = _generate(dirs, _config(dirs, method), enforce_eager=enforce_eager)
    stats = llm.engine.speculator.stats
    assert llm.engine.scheduler.num_preemptions > 0, "the cache is meant to be too small: nothing was preempted"
    assert stats.num_accepted > 0 and stats.num_drafted > stats.num_accepted, stats
    assert spec == plain
