"""llama.cpp's CPU rounding of activations against GGUF weights (its q8_0 / q8_1 / q8_K blocks), in torch."""

from __future__ import annotations

import torch
from torch import Tensor

# The activation block type llama.cpp's CPU backend rounds a matmul's input to, per GGUF weight type
# (ggml's vec_dot_type): q8_0 per 32 features with an fp16 scale; q8_1 the same plus each block's
# fp16 sum (scale times the codes' sum), which meets the weight's minimum; q8_K per 256 features
# with an fp32 scale.
FORMAT_OF_TYPE = {"Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
                  "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "MXFP4": "q8_0"}
BLOCK = {"q8_0": 32, "q8_1": 32, "q8_K": 256}
INT8_MAX = 127.0


def format_of(gguf_type: str | None) -> str | None:
    """The activation format of a GGUF weight (QuantizedWeight.gguf_type, "Q5_0+Q8_0" for a joined
    layer: its types share one), or None for a weight not read from GGUF blocks."""
    if not gguf_type:
        return None
    formats = {FORMAT_OF_TYPE.get(name) for name in gguf_type.split("+")}
    if len(formats) != 1 or None in formats:
        raise ValueError(f"GGUF weight types {gguf_type!r} do not share one llama.cpp activation format; "
                         f"known: {sorted(FORMAT_OF_TYPE)}")
    return formats.pop()


def round_activations(x: Tensor, fmt: str) -> tuple[Tensor, Tensor | None]:
    """x (T, K) float -> (x as llama.cpp's integer dot products see it, (T, K) float64, exact; q8_1's
    sum correction (T, K / 32) float64, else None).

    Per block of BLOCK[fmt] features: codes = round-half-even(x * (127 / absmax)) in fp32; scale
    absmax / 127 (q8_0, q8_1: rounded to fp16) or 1 / (127 / absmax) (q8_K); an all-zero block is
    zero. The rounded x is codes * scale. q8_1 also stores s = fp16(fp32 scale * sum(codes)), which
    llama.cpp multiplies by the weight's per-block minimum instead of scale * sum(codes): the
    correction is their difference, so that x_rounded @ W.T + correction @ minimums.T is its product
    for a Q4_1 / Q5_1 weight W (minimums (N, K / 32)). K must be a whole number of blocks.
    """
    if fmt not in BLOCK:
        raise ValueError(f"unknown llama.cpp activation format {fmt!r}; expected one of {sorted(BLOCK)}")
    tokens, k = x.shape
    block = BLOCK[fmt]
    if k % block:
        raise ValueError(f"{fmt} rounds whole blocks of {block} features; x has {k}")
    blocks = x.float().reshape(tokens, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse)
    if fmt == "q8_K":
        scale = torch.where(amax > 0, 1.0 / inverse, torch.zeros_like(amax))
    else:
        exact = amax / INT8_MAX
        scale = exact.half().float()
    rounded = (codes.double() * scale.double()).reshape(tokens, k)  # exact (q8_K's fp32 scale times a code is not)
    if fmt != "q8_1":
        return rounded, None
    sums = codes.sum(-1, keepdim=True)  # exact: at most 32 * 127
    correction = (exact * sums).half().double() - scale.double() * sums.double()  # exact in float64
    return rounded, correction.squeeze(-1)


def product(x: Tensor, weight: Tensor, fmt: str, minimums: Tensor | None = None) -> Tensor:
    """llama.cpp's x @ weight.T in float64 (the oracle of the kernels that round as it does): x
    (T, K), weight (N, K) the dequantized GGUF weight, minimums (N, K / 32) its per-block offsets
    (Q4_1 / Q5_1) or None; returns (T, N) float64."""
    rounded, correction = round_activations(x, fmt)
    out = rounded.double() @ weight.double().T
    if correction is not None and minimums is not None:
        out += correction.double() @ minimums.double().T
    return out
