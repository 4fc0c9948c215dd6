"""`flashllm quantize MODEL --method ...`: post-training quantization with a calibration set, written as a checkpoint."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# method -> (bits, default group size, needs calibration statistics)
METHODS: dict[str, tuple[int, int, bool]] = {
    "weight_only_int8": (8, -1, False),
    "weight_only_int4": (4, 128, False),
    "gptq": (4, 128, True),
    "awq": (4, 128, True),
    "smoothquant": (8, -1, True),
}


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    """Everything one quantization run needs; the CLI flags one to one."""

    model: str
    method: str
    output: Path
    calib: Path | None = None
    num_samples: int = 128
    seq_len: int = 512
    group_size: int | None = None
    bits: int | None = None
    desc_act: bool = False
    alpha: float = 0.5
    kv_scales: bool = False
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    backend: str | None = None
    progress: bool = True


def add_parser(sub: Any) -> None:
    p = sub.add_parser("quantize", help="post-training quantization (RTN, GPTQ, AWQ, SmoothQuant) to a new checkpoint")
    p.add_argument("model", help="HF model directory (safetensors)")
    p.add_argument("--method", required=True, choices=sorted(METHODS), help="quantization algorithm")
    p.add_argument("--output", required=True, type=Path, help="directory to write the quantized model to")
    p.add_argument("--calib", type=Path, default=None,
                   help='calibration JSONL of {"text": ...} lines (needed by gptq, awq, smoothquant and --kv-scales)')
    p.add_argument("--num-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input features per scale, -1 per output channel (default: 128; -1 for weight_only_int8)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=None, help="gptq only: 4 (default) or 8")
    p.add_argument("--desc-act", action="store_true", help="gptq only: quantize columns in act-order (g_idx)")
    p.add_argument("--alpha", type=float, default=0.5, help="smoothquant migration strength in [0, 1] (default 0.5)")
    p.add_argument("--kv-scales", action="store_true", help="also write static int8 KV-cache scales per layer")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration row sampling")
    p.add_argument("--dtype", default="auto", help="calibration dtype: auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default="auto", help="calibration device: auto | cpu | cuda | cuda:1 | ...")
    p.add_argument("--backend", default=None, help="force one backend for the calibration forward")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from flashllm.ptq.calibration import CalibrationDataError
    from flashllm.quant.gptq import PrequantizedFormatError

    options = QuantizeOptions(
        args.model, args.method, args.output, args.calib, args.num_samples, args.seq_len, args.group_size,
        args.bits, args.desc_act, args.alpha, args.kv_scales, args.seed, args.device, args.dtype, args.backend,
        not args.no_progress,
    )
    try:
        out = quantize_model(options)
    except (CalibrationDataError, PrequantizedFormatError, ValueError, OSError) as err:
        print(f"flashllm quantize: {err}", file=sys.stderr)
        return 2
    print(f"wrote {options.method} checkpoint to {out}")
    return 0


def check_options(options: QuantizeOptions) -> None:
    """Refuse flag combinations that cannot work, before anything is loaded."""
    if options.method not in METHODS:
        raise ValueError(f"--method {options.method!r} is not one of {', '.join(sorted(METHODS))}")
    needs_calib = METHODS[options.method][2] or options.kv_scales
    if needs_calib and options.calib is None:
        raise ValueError(f"--method {options.method}{' --kv-scales' if options.kv_scales else ''} needs a "
                         "calibration set: pass --calib FILE.jsonl")
    if options.desc_act and options.method != "gptq":
        raise ValueError("--desc-act is a gptq option; drop it or use --method gptq")
    if options.bits is not None and options.method != "gptq":
        raise ValueError(f"--bits applies to gptq only; {options.method} is {METHODS[options.method][0]}-bit")
    if options.method == "smoothquant" and options.group_size not in (None, -1):
        raise ValueError("smoothquant has one int8 scale per output channel; drop --group-size")
    if options.num_samples < 1 or options.seq_len < 2:
        raise ValueError(f"--num-samples ({options.num_samples}) must be >= 1 and --seq-len ({options.seq_len}) >= 2")


def quantize_model(options: QuantizeOptions) -> Path:
    """Calibrate (when the method needs it), quantize every linear layer and write the checkpoint."""
    from flashllm.eval.forward import ScoringConfig, load_scoring_parts, resolve_max_length
    from flashllm.ptq.calibration import linear_groups, read_calibration_texts
    from flashllm.ptq.writer import read_checkpoint, write_checkpoint

    check_options(options)
    _check_float_checkpoint(options.model)
    texts = read_calibration_texts(options.calib) if options.calib is not None else None
    seq_len = resolve_max_length(options.model, options.seq_len)
    parts = load_scoring_parts(ScoringConfig(options.model, options.dtype, options.device, options.backend), seq_len)
    groups = linear_groups(parts.model)
    stats = _calibrate(options, parts, texts, seq_len) if texts is not None else None
    del parts  # the float model is no longer needed; the checkpoint's own tensors are quantized
    tensors = read_checkpoint(options.model)
    tensors, config = _METHOD_RUNNERS[options.method](options, tensors, groups, stats)
    if options.kv_scales:
        from flashllm.ptq.writer import kv_scale_tensors

        tensors.update(kv_scale_tensors(stats))
    return write_checkpoint(options.model, options.output, tensors, config)


def _check_float_checkpoint(model_dir: str) -> None:
    from flashllm.models.hf_config import read_json_object
    from flashllm.models.loader import MAX_JSON_BYTES

    config = Path(model_dir) / "config.json"
    if config.is_file() and "quantization_config" in read_json_object(config, MAX_JSON_BYTES):
        raise ValueError(f"{model_dir} is already quantized (its config.json has a quantization_config); "
                         "quantize the float model it came from")


def _calibrate(options: QuantizeOptions, parts: Any, texts: list[str], seq_len: int) -> Any:
    from flashllm.eval.forward import window_hidden
    from flashllm.ptq.calibration import (
        DEFAULT_MAX_SAMPLE_ROWS,
        CalibrationDataError,
        StatsRequest,
        collect_stats,
        tokenize_windows,
    )

    if parts.tokenizer is None:
        raise CalibrationDataError(f"{options.model} has no tokenizer, so calibration text cannot be tokenized")
    windows = tokenize_windows(texts, parts.tokenizer, options.num_samples, seq_len)
    request = StatsRequest(hessian=options.method == "gptq",
                           max_sample_rows=DEFAULT_MAX_SAMPLE_ROWS if options.method == "awq" else 0,
                           kv=options.kv_scales)
    return collect_stats(parts.model, windows, lambda ids: window_hidden(parts, ids), request,
                         progress=options.progress, seed=options.seed)


def _group_size(options: QuantizeOptions) -> int:
    return METHODS[options.method][1] if options.group_size is None else options.group_size


def _run_rtn_or_gptq(options: QuantizeOptions, tensors: dict, groups: list, stats: Any) -> tuple[dict, Any]:
    from tqdm.auto import tqdm

    from flashllm.ptq.writer import QuantizationConfig, replace_with_codes
    from flashllm.quant.gptq_solver import gptq_quantize, rtn_quantize

    bits = options.bits or METHODS[options.method][0]
    group_size = _group_size(options)
    for group in tqdm(groups, desc=f"Quantizing ({options.method})", unit="layer", disable=not options.progress):
        weight = group.fused_weight(tensors)
        try:
            if options.method == "gptq":
                hessian = stats.linears[group.module].hessian
                codes = gptq_quantize(weight.to(hessian.device), hessian, bits, group_size, True, options.desc_act)
            else:
                codes = rtn_quantize(weight, bits, group_size, sym=True)
        except ValueError as err:
            raise ValueError(f"{group.module} {tuple(weight.shape)}: {err}") from None
        replace_with_codes(tensors, group, codes, "gptq")
    return tensors, QuantizationConfig("gptq", bits, group_size, options.desc_act, sym=True)


def _run_awq(options: QuantizeOptions, tensors: dict, groups: list, stats: Any) -> tuple[dict, Any]:
    from flashllm.ptq.awq_search import awq_tensors
    from flashllm.ptq.writer import QuantizationConfig, replace_with_codes

    group_size = _group_size(options)
    tensors, codes, _ = awq_tensors(tensors, groups, stats, 4, group_size)
    for group in groups:
        replace_with_codes(tensors, group, codes[group.module], "awq")
    return tensors, QuantizationConfig("awq", 4, group_size)


def _run_smoothquant(options: QuantizeOptions, tensors: dict, groups: list, stats: Any) -> tuple[dict, Any]:
    from flashllm.ptq.smoothquant import smoothquant_tensors
    from flashllm.ptq.writer import QuantizationConfig

    return smoothquant_tensors(tensors, groups, stats, options.alpha), QuantizationConfig("smoothquant", 8, -1,
                                                                                          alpha=options.alpha)


_METHOD_RUNNERS = {
    "weight_only_int8": _run_rtn_or_gptq,
    "weight_only_int4": _run_rtn_or_gptq,
    "gptq": _run_rtn_or_gptq,
    "awq": _run_awq,
    "smoothquant": _run_smoothquant,
}


def main(argv: list[str] | None = None) -> int:
    """`python -m flashllm.cli.quantize ...`: the same command without the top-level `flashllm` parser."""
    parser = argparse.ArgumentParser(prog="flashllm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["quantize", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
