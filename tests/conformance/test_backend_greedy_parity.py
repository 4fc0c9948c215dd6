"""Each built-in backend available here runs a tiny Llama end to end with the reference's greedy tokens.

The kernel conformance suite checks ops one at a time; this checks them composed by the engine
(prefill, decode across a block boundary, a GQA model, strict kernels so no op silently falls
back to the reference). `nox -s "conformance(backend='cpu')"` selects it with `-k cpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flashllm.llm import LLM
from flashllm.registry.plugins import make_plugin_manager
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

BACKENDS = ["cpu", "cuda", "ipex", "xla"]
PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2]]
# head size 64, the smallest every backend's attention claims (cuda: 64-256, npu: 64-128), so strict
# kernels resolve everywhere; hidden 256 over 4 query heads and 2 kv heads keeps the tiny base's GQA
HEAD_SIZE_64 = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=4, tokenizer=False, **HEAD_SIZE_64)


def _greedy(model_dir: Path, backend: str) -> list[list[int]]:
    llm = LLM(str(model_dir), backend=backend, dtype="float32", block_size=16, num_kv_blocks=16,
              max_model_len=128, strict_kernels=backend != "reference")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # 20 + 24 tokens cross a block
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_llama_greedy_tokens_match_the_reference(model_dir: Path, backend: str) -> None:
    available, reason = make_plugin_manager().backends()[backend].is_available()
    if not available:
        pytest.skip(f"{backend}: {reason}")
    assert _greedy(model_dir, backend) == _greedy(model_dir, "reference")
