"""What the CPU harnesses beside this file share: the qwen2.5-0.5b shape's product sizes, a native
build loaded with the package's signatures, and an engine set up for one greedy request."""

from __future__ import annotations

import ctypes

from flashllm import LLM, SamplingParams
from flashllm.bench.shapes import SHAPES, shape_model_dir
from flashllm.bench.workload import BenchRequest, random_requests, warm_up_prompt

SHAPE = "qwen2.5-0.5b"
CONFIG = SHAPES[SHAPE]


def token_products() -> list[tuple[int, int]]:
    """(out, in) features of one token's products, in the engine's order: per layer fused qkv,
    o_proj, fused gate_up, down; then the LM head."""
    h, inter, heads, kv_heads = (CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                    "num_key_value_heads"))
    qkv = h + 2 * kv_heads * (h // heads)
    return [(qkv, h), (h, h), (2 * inter, h), (h, inter)] * CONFIG["num_hidden_layers"] + [(CONFIG["vocab_size"], h)]


def load_library(path: str) -> ctypes.CDLL:
    """A build of flashllm/backends/cpu/csrc with the argument types the package gives its own."""
    from flashllm.backends.cpu import native

    lib = ctypes.CDLL(path)
    for name, (argtypes, restype) in native._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def greedy_engine(tokens: int, prompt: int = 128) -> tuple[LLM, BenchRequest, SamplingParams]:
    """The shape's fp32 engine on the CPU, warmed up, with one request of a `prompt`-token prompt
    and `tokens` greedy output tokens (EOS ignored)."""
    llm = LLM(str(shape_model_dir(SHAPE, "float32")), device="cpu", max_model_len=4096)
    (request,) = random_requests(1, (prompt, prompt), (tokens, tokens), CONFIG["vocab_size"], 0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm.generate([warm_up_prompt(request)], SamplingParams(max_tokens=2, detokenize=False))
    return llm, request, params
