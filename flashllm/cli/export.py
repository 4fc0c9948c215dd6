"""`flashllm export MODEL --format onnx --output DIR`: write a static-graph (ONNX) version of a model."""

from __future__ import annotations

import argparse
from typing import Any

FORMATS = ("onnx",)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("export", help="export a model to a static graph (ONNX) for --mode static")
    parser.add_argument("model", help="HF model directory (Llama or Qwen2, safetensors)")
    parser.add_argument("--format", default="onnx", choices=FORMATS, help="graph format (default onnx)")
    parser.add_argument("--output", required=True, help="directory to write (new, empty, or an earlier export)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="weights and KV cache dtype of the graph; logits are always float32")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18, the exporter's minimum)")


def run(args: argparse.Namespace) -> int:
    from flashllm.static.export import DEFAULT_OPSET, export_onnx, require_export_packages

    require_export_packages()
    manifest = export_onnx(args.model, args.output, dtype=args.dtype, opset=args.opset or DEFAULT_OPSET)
    print(f"exported {manifest.architecture} ({manifest.num_layers} layers, {manifest.dtype}, opset "
          f"{manifest.opset}) to {args.output}; run it with `flashllm predict --model_name_or_path "
          f"{args.output} --mode static ...`")
    return 0
