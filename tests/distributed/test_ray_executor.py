"""The ray executor: rank 1 runs as a Ray actor on a local cluster; tokens match one rank's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPTS = [[(3 * i + 2) % 250 + 1 for i in range(30)], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def local_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster, loopback only
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def generate(model_dir: Path, **options) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, block_size=16, max_num_batched_tokens=16, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
        return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.shutdown()


def test_ray_ranks_match_one_rank(local_cluster, tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "model", "qwen2", seed=13, tokenizer=False)
    one = generate(model_dir)
    two = generate(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4
