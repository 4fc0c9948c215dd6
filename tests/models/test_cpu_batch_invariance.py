"""The cpu backend on an fp32 model, with the AVX2 fp32 paths (on any x86-64 CPU): a request's decode
logprobs are the same floats alone, in a batch, and with n-gram speculation (its verify steps score
1 + k rows), so near-ties cannot turn into other tokens. Prompts stay short (a whole first step of 32
tokens or fewer) because longer prompt steps run the BLAS GEMM, whose sums are another order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flashllm.backends.cpu import native
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

# a copy of their own start in two of them, so the lookup drafts and verify steps take 1 + k rows
PROMPTS = [[11, 12, 13, 14, 15, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 40, 41], [7, 3, 9, 120, 5, 6, 33, 2]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("invariance"), "llama", seed=5, tokenizer=False)


@pytest.fixture(autouse=True)
def avx2_paths() -> Iterator[None]:
    """The AVX2 fp32 products for one test (the AVX-512 ones sum one token in another order than a batch)."""
    default = native.f32_rows()
    native.f32_rows(2)
    yield
    native.f32_rows(default)


def _decode(model_dir: Path, prompts: list[list[int]], speculative: dict | None = None) -> list[tuple]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=64, enable_prefix_caching=False, speculative_config=speculative)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.speculator.stats if speculative else None
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs], stats


def test_logprobs_are_the_same_floats_alone_in_a_batch_and_speculating(model_dir: Path) -> None:
    alone = [_decode(model_dir, [prompt])[0][0] for prompt in PROMPTS]
    together, _ = _decode(model_dir, PROMPTS)
    speculating, stats = _decode(model_dir, PROMPTS, NGRAM)
    assert stats.num_accepted > 0 and stats.num_drafted > stats.num_accepted, stats
    for i, (tokens, logprobs) in enumerate(alone):
        assert together[i][0] == tokens and speculating[i][0] == tokens, f"request {i}: tokens"
        assert together[i][1] == logprobs, f"request {i}: logprobs in a batch"
        assert speculating[i][1] == logprobs, f"request {i}: logprobs with speculation"
