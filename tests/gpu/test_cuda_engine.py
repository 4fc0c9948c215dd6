"""The engine on a real NVIDIA GPU: decode graphs, memory sizing and the cuda kernels composed.

Skipped without a GPU (CI has none); run on a lent GPU with `python -m pytest tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# head size 64: the smallest the Triton attention claims
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], [9, 4, 4, 4, 2, 61, 3, 3, 30, 2, 1], [7] * 70]
MAX_TOKENS = (40, 9, 66, 17, 25)  # finishing at different steps: the batch shrinks through graph sizes


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3, tokenizer=False, **SHAPE)


def _run(model_dir: Path, **kwargs: Any) -> tuple[LLM, list[list[int]], list[list[float]]]:
    options = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 4}
    llm = LLM(str(model_dir), **{**options, **kwargs})
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    return llm, [o.outputs[0].token_ids for o in outputs], [list(o.outputs[0].logprobs) for o in outputs]


def test_graphs_give_the_eager_and_reference_greedy_tokens(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.backends.cuda import CudaStepGraph

    replays = {"n": 0}
    original = CudaStepGraph.replay

    def counted(self: CudaStepGraph) -> None:
        replays["n"] += 1
        original(self)

    monkeypatch.setattr(CudaStepGraph, "replay", counted)
    llm, graphed, graphed_lp = _run(model_dir, device="cuda", strict_kernels=True)
    assert llm.engine.runner.graphs is not None and replays["n"] > 0
    _, eager, eager_lp = _run(model_dir, device="cuda", strict_kernels=True, enforce_eager=True)
    _, reference, _ = _run(model_dir, device="cpu", backend="reference")
    assert graphed == eager == reference
    for got, want in zip(graphed_lp, eager_lp, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


def test_bf16_graphs_match_the_eager_engine(model_dir: Path) -> None:
    _, graphed, graphed_lp = _run(model_dir, device="cuda", dtype="bfloat16")
    _, eager, eager_lp = _run(model_dir, device="cuda", dtype="bfloat16", enforce_eager=True)
    # the graphs read block tables as wide as max_model_len, so attention splits the context
    # differently from an eager step: bf16 rounding may differ, the distributions may not
    agree = sum(a == b for g, e in zip(graphed, eager, strict=True) for a, b in zip(g, e, strict=False))
    assert agree >= 0.95 * sum(MAX_TOKENS)
    first = torch.tensor([lp[0] for lp in graphed_lp]), torch.tensor([lp[0] for lp in eager_lp])
    torch.testing.assert_close(*first, rtol=0, atol=0.05)


def test_kv_cache_is_sized_from_a_memory_profile(model_dir: Path) -> None:
    total = torch.cuda.mem_get_info()[1]
    small = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.05)
    small_bytes, small_blocks = small.engine.runner.kv_cache_bytes(), small.engine.parts.num_blocks
    assert 0 < small_bytes <= 0.05 * total
    del small
    torch.cuda.empty_cache()
    large = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.1)
    assert large.engine.parts.num_blocks > small_blocks
    out = large.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
