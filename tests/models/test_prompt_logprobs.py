"""Prompt logprobs equal transformers' log-softmax of the prompt (fp32, 1e-4), with and without chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("plp"), "qwen2", seed=5, tokenizer=False)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (130, 17, 2, 64)]


def _check(hf_model, prompts, outputs) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
        got = output.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        chosen = torch.tensor([entry[0] for entry in got[1:]])
        torch.testing.assert_close(chosen, expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                                   atol=1e-4, rtol=0)
        for p, entry in enumerate(got[1:]):
            values, indices = expected[p].topk(TOP)
            assert [i for i, _ in entry[1]] == indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in entry[1]]), values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [None, 24])
def test_prompt_logprobs_match_transformers(model_dir, hf_model, chunk) -> None:
    options = dict(dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    if chunk is not None:
        options["max_num_batched_tokens"] = chunk  # the 130-token prompt runs in six chunks
    llm = LLM(str(model_dir), **options)
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP, n=2)
    # a first request fills the prefix cache: prompt logprobs must not take hits from it
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))
    _check(hf_model, prompts, llm.generate(prompts, params))
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[0].prompt_logprobs is None
