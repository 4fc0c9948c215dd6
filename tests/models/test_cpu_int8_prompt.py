"""Prompts of int8/int4 weights on the cpu backend's integer kernels (native.prompt_linear) against the fp32 path.

The fp32 path (FLASHLLM_CPU_PROMPT_ACTIVATIONS=fp32, the default) dequantizes each weight and runs a BLAS
GEMM: the dequantized float model's arithmetic. The integer path rounds the activations per token and block
of 64 features; with =int8x2 to two int8 terms, which carry each feature to within absmax / 64516 of its block
(2^-16 of the block's largest |x|), so a linear's output moves by at most that times sum |w| |x|_max:
about 1e-5 of its scale, and a tiny model's logprobs by ~1e-5 (measured 1e-5..4e-5 here; gate 1e-3).
One int8 term (llama.cpp's rounding, absmax / 254) moves them ~250x as far, which the test also
measures, so the gate would catch a path that rounded like that (or worse: a wrong scale, a stale row).

Prompts are longer than a decode batch (native.MAX_TOKENS) and run whole and in chunks (chunked
prefill, 40 tokens a step, so the last chunk of 130 is decode-sized and takes the decode kernels,
held exact here as the fp32 path's are): greedy tokens must equal the fp32 path's; f24afec's fault (SmolLM2's quick-start answer lost) was a
prompt-path change no default-CI test ran. The hidden size 256 and intermediate 512 are whole pairs of
64-feature blocks, so the AVX-512 VNNI bodies run where the CPU has them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from flashllm.backends.cpu import native  # noqa: E402
from flashllm.llm import LLM  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.gguf_files import write_gguf  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
LENGTHS = (130, 45, 33)
GATE = 1e-3  # |logprob difference|, two int8 terms vs fp32 (see the module docstring)
pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("int8prompt"), "llama", seed=6, **SHAPE)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(17)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _run(llm: LLM, prompts: list[list[int]], mode: str, monkeypatch) -> tuple[list[list[int]], torch.Tensor, int]:
    """(greedy tokens, every prompt position's top-1 logprob, prompt_linear calls) with the prompt path `mode`."""
    monkeypatch.setenv(native.PROMPT_ACTIVATIONS_ENV, mode)
    calls = [0]
    real = native.prompt_linear

    def counted(x, weight):
        calls[0] += 1
        return real(x, weight)

    monkeypatch.setattr(native, "prompt_linear", counted)
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    monkeypatch.setattr(native, "prompt_linear", real)
    chosen = torch.tensor([entry[0] for o in outputs for entry in o.prompt_logprobs[1:]])
    return [o.outputs[0].token_ids for o in outputs], chosen, calls[0]


@pytest.mark.parametrize("weights", ["gguf-Q8_0", "gguf-Q4_1", "gguf-Q4_0", "w8a16", "w8a16-g128"])
@pytest.mark.parametrize("chunk", [None, 40])
def test_prompt_path_keeps_the_fp32_paths_tokens(source, weights, chunk, tmp_path, monkeypatch, request):
    options = dict(dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64,
                   enable_prefix_caching=False)
    if chunk is not None:
        options["max_num_batched_tokens"] = chunk
    # decode-sized steps exact too: GGUF weights' decode kernels round activations to one int8 term by
    # default, a step function that turns the prompt path's 1e-5 into rounding-sized jumps downstream
    monkeypatch.setenv(native.W8_ACTIVATIONS_ENV, "fp32")
    monkeypatch.setenv(native.INT4_ACTIVATIONS_ENV, "fp32")
    bf16_min = native.w8_bf16_min()
    native.w8_bf16_min(0)  # per-channel w8a16's exact fp32 tiles, not its bf16 activations, as the yardstick
    request.addfinalizer(lambda: native.w8_bf16_min(bf16_min))
    if weights.startswith("gguf-"):
        model = str(write_gguf(source, tmp_path / "model.gguf", weights.removeprefix("gguf-")))
    else:
        model = str(source)
        options["quant_type"] = "weight_only_int8"
        if weights.endswith("g128"):
            options["group_size"] = 128
    llm = LLM(model, **options)
    prompts = _prompts(json.loads((source / "config.json").read_text())["vocab_size"])
    exact_tokens, exact, none = _run(llm, prompts, "fp32", monkeypatch)
    tokens, two, calls = _run(llm, prompts, "int8x2", monkeypatch)
    _, one, _ = _run(llm, prompts, "int8", monkeypatch)
    assert none == 0 and calls > 0  # the fp32 run never took the integer path, the default did
    assert tokens == exact_tokens
    err_two, err_one = float((two - exact).abs().max()), float((one - exact).abs().max())
    assert err_two <= GATE, err_two
    assert err_one > 10 * err_two, (err_one, err_two)  # the comparison sees rounding of one int8 term's size
