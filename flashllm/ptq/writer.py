"""Write a post-training-quantized checkpoint: GPTQ / AWQ / SmoothQuant tensors, quantization_config, side files."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from flashllm.models.hf_config import read_json_object
from flashllm.models.loader import MAX_JSON_BYTES, safetensors_files
from flashllm.ptq.calibration import CalibrationStats, LinearGroup
from flashllm.quant.awq import pack_awq
from flashllm.quant.gptq import IntegerWeight, pack_gptq

# files of a model directory copied unchanged beside the new weights (tokenizer, chat template, sampling defaults)
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja",
)
KV_SCALE_SUFFIXES = ("k_scale", "v_scale")
INT8_MAX = 127
_MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """What `quantization_config` in config.json says about the written weights."""

    method: str
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    alpha: float = 0.5

    def to_json(self) -> dict[str, Any] | None:
        """config.json's `quantization_config`: the Hugging Face spelling for gptq and awq.

        smoothquant has none: its int8 weights are recognised by dtype (quant/spec.py's layout) and
        the loader refuses quant_methods other than gptq/awq, so the model loads as a float
        checkpoint would, with `--quant_type a8w8` keeping the codes as they are.
        """
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                    "desc_act": self.desc_act, "sym": self.sym, "checkpoint_format": "gptq",
                    "static_groups": False, "true_sequential": False}
        if self.method == "awq":
            return {"quant_method": "awq", "version": "gemm", "zero_point": True, "bits": self.bits,
                    "group_size": self.group_size, "modules_to_not_convert": None}
        if self.method == "smoothquant":
            return None
        raise ValueError(f"no quantization_config spelling for method {self.method!r}; expected gptq, awq or smoothquant")


def read_checkpoint(model_dir: str | Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors model directory (single file or sharded), on the CPU, in its stored dtype."""
    tensors: dict[str, Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def replace_with_codes(tensors: dict[str, Tensor], group: LinearGroup, weight: IntegerWeight,
                       layout: str) -> None:
    """Swap each shard's float `<prefix>.weight` for its packed tensors, in place.

    layout "gptq": qweight, qzeros (v1: zero - 1), scales fp16, g_idx; "awq": GEMM qweight,
    qzeros, scales fp16. A shard's rows of the fused codes become that shard's tensors; biases stay.
    """
    start = 0
    for prefix, rows in zip(group.prefixes, group.shard_rows(tensors), strict=True):
        part = slice(start, start + rows)
        codes, zeros, scales = (t[part].cpu() for t in (weight.codes, weight.zeros, weight.scales))
        if layout == "gptq":
            packed = pack_gptq(codes, zeros, scales, weight.g_idx.cpu(), bits=weight.bits, checkpoint_format="gptq")
        elif layout == "awq":
            packed = pack_awq(codes, zeros, scales)
        else:
            raise ValueError(f"unknown packed layout {layout!r}; expected 'gptq' or 'awq'")
        del tensors[f"{prefix}.weight"]
        tensors.update({f"{prefix}.{name}": t.contiguous() for name, t in packed.items()})
        start += rows


def kv_scale_tensors(stats: CalibrationStats) -> dict[str, Tensor]:
    """Static int8 KV-cache scales: `<block>.k_scale` / `<block>.v_scale` = max |k| / 127 per KV head, fp32 (Hk,)."""
    if not stats.kv_absmax:
        raise ValueError("no K/V statistics were collected; run the calibration with StatsRequest(kv=True)")
    out = {}
    for block, maxima in stats.kv_absmax.items():
        for suffix, absmax in zip(KV_SCALE_SUFFIXES, maxima, strict=True):
            out[f"{block}.{suffix}"] = (absmax.to(torch.float32).cpu() / INT8_MAX).clamp(min=_MIN_SCALE)
    return out


def write_checkpoint(source_dir: str | Path, out_dir: str | Path, tensors: dict[str, Tensor],
                     config: QuantizationConfig) -> Path:
    """Write model.safetensors, config.json (+ quantization_config) and the source's side files to out_dir.

    One unsharded file: enough for the models this tool has been run on (up to ~1.5B parameters
    at 4 bits); sharding above 4 GB is not implemented. out_dir must not be source_dir.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.resolve() == source_dir.resolve():
        raise ValueError(f"--output {out_dir} is the source model directory; write the quantized model elsewhere")
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = read_json_object(source_dir / "config.json", MAX_JSON_BYTES)
    quantization_config = config.to_json()
    if quantization_config is not None:
        hf_config["quantization_config"] = quantization_config
    save_file({name: t.contiguous() for name, t in tensors.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    for name in SIDE_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out_dir / name)
    return out_dir
