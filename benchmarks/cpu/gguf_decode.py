"""Batch-1 greedy decode of the qwen2.5-0.5b shape with its linear layers in GGUF layouts, on the cpu backend.

    python benchmarks/cpu/gguf_decode.py Q4_0 --tokens 64 --repeats 3
    python benchmarks/cpu/gguf_decode.py f32            # flashllm's own fp32 path, the same harness

Until the GGUF loader lands this builds the layouts itself: every linear layer the engine would
quantize (quant_type w8a16/w4a16, plus the LM head with --quantize_lm_head) is replaced, at load, by
weight_from_gguf on random blocks of the format (random codes, fp16 scales about 1e-3: speed does not
depend on the values, so the tokens are noise). Formats: one GGUF type for every linear and the
head, or "Q4_K_M" / "Q5_K_M" as llama.cpp writes them for this shape: rows of 896 features are not
whole 256-feature super-blocks, so llama.cpp falls back to Q5_0 (Q4_K_M) / Q5_1 (Q5_K_M) for q, k,
gate and up, Q8_0 for v and the head; ffn_down (4864 features) is Q4_K / Q5_K, Q6_K in the layers
llama.cpp's use_more_bits picks. Prints the decode rate (median of --repeats runs), the bytes one
token streams (flashllm.models.weight_bytes) and the fraction of the read-bandwidth ceiling
(flashllm.bench.roofline, measured in the same run).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flashllm import LLM, SamplingParams
from flashllm.bench import offline, roofline
from flashllm.bench.shapes import SHAPES, shape_model_dir
from flashllm.bench.workload import random_requests, warm_up_prompt
from flashllm.models.layers import embedding, linear
from flashllm.models.weight_bytes import weight_bytes
from flashllm.quant.gguf_blocks import weight_from_gguf

T = GGMLQuantizationType
SHAPE = "qwen2.5-0.5b"
LAYERS = SHAPES[SHAPE]["num_hidden_layers"]
MIXES = {"Q4_K_M": (T.Q5_0, T.Q4_K), "Q5_K_M": (T.Q5_1, T.Q5_K)}  # (896-wide rows, ffn_down)
# byte offsets of each type's fp16 fields in a block
HALF_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,)}


def more_bits(layer: int, layers: int = LAYERS) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) of random blocks whose fp16 fields are about +-1e-3 (finite, normal)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    for start in HALF_FIELDS[qtype]:
        halves = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-3).astype(np.float16)
        raw[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def layout_factory(fmt: str):
    """quantize_weight's stand-in for `fmt` (called once per linear, in load order: qkv, o, gate_up, down)."""
    rng = np.random.default_rng(0)
    downs = iter(range(LAYERS))

    def make(weight: torch.Tensor, scheme: str, group_size: int = -1, symmetric: bool = True, smooth=None):
        n, k = weight.shape
        if n == SHAPES[SHAPE]["vocab_size"]:
            qtype = T.Q8_0  # llama.cpp's head of this shape in every quantized file (Q6_K's fallback)
        elif fmt in MIXES:
            narrow, down = MIXES[fmt]
            qtype = (T.Q6_K if more_bits(next(downs)) else down) if k % 256 == 0 else narrow
        else:
            qtype = T[fmt]
        return weight_from_gguf(random_blocks(qtype, n, k, rng), qtype, (n, k))

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", help="f32, a GGUF type name (Q8_0, Q4_0, ...) or Q4_K_M / Q5_K_M")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kwargs = {}
    if args.format != "f32":
        # the engine's load-time quantizers, for this run: the linears' and the LM head's
        linear.quantize_weight = embedding.quantize_weight = layout_factory(args.format)
        kwargs = {"quant_type": "w4a16", "quantize_lm_head": True}
    llm = LLM(str(shape_model_dir(SHAPE, "float32")), device="cpu", max_model_len=4096, **kwargs)
    model = llm.engine.parts.model
    streamed = weight_bytes(model).streamed
    (request,) = random_requests(1, (args.prompt, args.prompt), (args.tokens, args.tokens), SHAPES[SHAPE]["vocab_size"], 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    llm.generate([warm_up_prompt(request)], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    rates = [offline._timed_generate(llm, [request], [params])["decode_tokens_per_s"] for _ in range(args.repeats)]
    bandwidth = roofline.measure_read_bandwidth()
    rate = statistics.median(rates)
    ceiling = bandwidth / streamed
    print(f"{args.format}: decode {rate:.1f} tokens/s (runs {', '.join(f'{r:.1f}' for r in rates)}); streams "
          f"{streamed / 1e6:.0f} MB/token; read bandwidth {bandwidth / 1e9:.1f} GB/s -> ceiling {ceiling:.1f} "
          f"tokens/s; {rate / ceiling:.2f} of it")


if __name__ == "__main__":
    main()
