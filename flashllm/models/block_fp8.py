"""Block-FP8 checkpoints (DeepSeek-V3's format, also MiniMax-M2's and the official FP8 releases of Qwen3 / GLM-4.5):
each projection weight stored as float8_e4m3fn codes with `weight_scale_inv`, one fp32 scale per (rows x cols) block,
named by `quantization_config` {quant_method: "fp8", fmt: "e4m3", weight_block_size: [rows, cols]}. flashllm
dequantizes them as they load (code x block scale), so the model runs its float weights (or --quant_type's)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from flashllm.models.checkpoint_tensor import materialize
from flashllm.models.errors import ModelLoadError

BLOCK_FP8 = "fp8"
_SCALE_INV = ".weight_scale_inv"


def is_block_fp8(qc: Any) -> bool:
    """Whether a quantization_config names block FP8 (its quant_method), valid or not (block_fp8_size checks it)."""
    return isinstance(qc, dict) and qc.get("quant_method") == BLOCK_FP8


def block_fp8_size(qc: Any, source: str, family: str) -> tuple[int, int] | None:
    """A block-FP8 quantization_config (DeepSeek-V3's, MiniMax-M2's) -> its weight_block_size; None without one.
    Raises ModelLoadError (one line, naming `family`) for any other quantization_config."""
    if qc is None:
        return None
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if (not isinstance(qc, dict) or qc.get("quant_method") != BLOCK_FP8 or qc.get("fmt", "e4m3") != "e4m3"
            or not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 4096 for b in block)):
        raise ModelLoadError(f"{source}: quantization_config={qc!r} is not supported; {family} checkpoints load "
                             "as float or as block FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size "
                             "[rows, cols])")
    return block[0], block[1]


def dequantize_block_fp8(weights: Iterable[tuple[str, Tensor]], block: tuple[int, int]
                         ) -> Iterator[tuple[str, Tensor]]:
    """Pair each float8_e4m3fn `X.weight` with its `X.weight_scale_inv` (ceil(N/rows), ceil(K/cols)) fp32 and
    yield `X.weight` = code * scale of its block, in fp32; everything else passes through.

    Raises ModelLoadError for a weight without its scale (or the reverse) or a scale of the wrong shape.
    """
    pending: dict[str, Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_SCALE_INV):
            key, other = name[: -len(_SCALE_INV)] + ".weight", name
        elif tensor.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
            key, other = name, name[: -len(".weight")] + _SCALE_INV
        else:
            yield name, tensor
            continue
        if other not in pending and key not in pending:
            pending[name] = tensor
            continue
        partner = pending.pop(other if name == key else key)
        codes, scales = (tensor, partner) if name == key else (partner, tensor)
        yield key, _dequantize(key, materialize(codes), materialize(scales).float(), block)
    if pending:
        raise ModelLoadError(f"block-FP8 checkpoint: {len(pending)} tensor(s) without their pair "
                             f"(weight / weight_scale_inv), e.g. {sorted(pending)[0]!r}; the checkpoint is incomplete")


def _dequantize(name: str, codes: Tensor, scales: Tensor, block: tuple[int, int]) -> Tensor:
    rows, cols = codes.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if codes.dtype != torch.float8_e4m3fn or tuple(scales.shape) != expected:
        raise ModelLoadError(f"block-FP8 tensor {name!r}: {codes.dtype} {tuple(codes.shape)} with scales "
                             f"{tuple(scales.shape)}; expected float8_e4m3fn codes and {expected} scales "
                             f"(one per {block[0]}x{block[1]} block)")
    full = scales.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return codes.float() * full
