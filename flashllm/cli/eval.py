"""`flashllm eval ppl|rouge|kl`: perplexity, ROUGE against references, KL divergence between configurations."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from flashllm.cli.parallel_flags import add_parallel_flags, parallel_options


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("eval", help="accuracy: perplexity, ROUGE, KL divergence between configurations")
    modes = parser.add_subparsers(dest="mode", required=True)
    _add_ppl_parser(modes.add_parser("ppl", help="sliding-window perplexity of a text file"))
    _add_rouge_parser(modes.add_parser("rouge", help="ROUGE-1/2/L/Lsum of greedy outputs (or given predictions)"))
    _add_kl_parser(modes.add_parser("kl", help="KL(baseline || candidate) and top-1 agreement on a text"))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_engine_flags(p: argparse.ArgumentParser, prefix: str = "", who: str = "") -> None:
    p.add_argument(f"--{prefix}dtype", default="auto", help=f"{who}auto | float32 | float16 | bfloat16")
    p.add_argument(f"--{prefix}device", default="auto", help=f"{who}auto | cpu | cuda | cuda:1 | ...")
    p.add_argument(f"--{prefix}backend", default=None, help=f"{who}force one backend, e.g. reference or cpu")
    p.add_argument(f"--{prefix}quant-type", default=None, help=f"{who}weight quantization scheme")
    p.add_argument(f"--{prefix}kv-cache-dtype", default="auto", help=f"{who}auto | int8 | fp8 (dynamic scales)")
    p.add_argument(f"--{prefix}weightonly-group-size", dest=f"{prefix.replace('-', '_')}group_size", type=int,
                   default=-1, help=f"{who}-1 (per output channel) or 32 | 64 | 128")
    p.add_argument(f"--{prefix}quantize-lm-head", action="store_true",
                   help=f"{who}store the LM head as int8 too (with a weight-only int8/int4 quant type)")
    add_parallel_flags(p, prefix=prefix, who=who)


def _add_window_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, type=Path, help="UTF-8 text file to score")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per window (default: 1024, capped at the model's max_position_embeddings)")
    p.add_argument("--stride", type=int, default=None, help="tokens each window moves by (default: max-length / 2)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="run each window as chunked prefill steps of this many tokens, through the kernels "
                        "a decode batch of that size takes (default: one prefill per window)")


def _add_ppl_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory")
    _add_window_flags(p)
    _add_engine_flags(p)
    _add_common(p)


def _add_rouge_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, type=Path, help='JSONL of {"src": ..., "tgt": ...}')
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", default=None, help="HF model directory to generate with")
    source.add_argument("--predictions", type=Path, default=None,
                        help='JSONL of predictions, one per --data line ({"prediction"} or {"output"}); no model')
    p.add_argument("--reference", choices=["transformers"], default=None,
                   help="also generate with transformers on the same weights and score both")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens generated per example")
    p.add_argument("--no-chat-template", action="store_true", help="prompt with the raw src even if the model "
                                                                   "has a chat template")
    p.add_argument("--save-predictions", type=Path, default=None, help="write the generated texts as JSONL")
    _add_engine_flags(p)
    _add_common(p)


def _add_kl_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory of the candidate")
    p.add_argument("--baseline-model", default=None, help="HF model directory of the baseline (default: --model)")
    _add_window_flags(p)
    _add_engine_flags(p, who="candidate: ")
    _add_engine_flags(p, prefix="baseline-", who="baseline: ")
    _add_common(p)


def run(args: argparse.Namespace) -> int:
    from flashllm.eval.data import EvalDataError

    handlers = {"ppl": _run_ppl, "rouge": _run_rouge, "kl": _run_kl}
    try:
        result = handlers[args.mode](args)
    except (EvalDataError, OSError, ValueError, ImportError) as err:
        print(f"flashllm eval {args.mode}: {err}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


def _windows(args: argparse.Namespace, model_dir: str) -> tuple[int, int]:
    from flashllm.eval.forward import resolve_max_length
    from flashllm.eval.windows import check_window

    max_length = resolve_max_length(model_dir, args.max_length)
    stride = args.stride or max(1, max_length // 2)
    check_window(max_length, stride)  # before loading any weights
    return max_length, stride


def _require_one_rank(args: argparse.Namespace, prefixes: tuple[str, ...]) -> None:
    """ppl and kl score on one rank (prompt logprobs are computed on one; kl runs eval/forward.py), so they refuse
    several ranks."""
    for prefix in prefixes:
        options = parallel_options(args, prefix)
        if options["tensor_parallel_size"] != 1 or options["distributed_executor_backend"] not in (None, "uniproc"):
            flags = " / ".join(f"--{prefix.replace('_', '-')}{name}"
                               for name in ("tensor-parallel-size", "distributed-executor-backend"))
            raise ValueError(f"{flags}: eval {args.mode} scores with the model in this one process, so it runs one "
                             "rank; drop these flags, or use eval rouge, which generates through the engine")


def _scoring_config(args: argparse.Namespace, model: str, prefix: str = "") -> Any:
    from flashllm.eval.forward import ScoringConfig

    return ScoringConfig(model, *(getattr(args, prefix + name) for name in ("dtype", "device", "backend", "quant_type", "kv_cache_dtype", "group_size", "quantize_lm_head")))


def _run_ppl(args: argparse.Namespace) -> dict[str, Any]:
    from flashllm.eval.data import read_text
    from flashllm.eval.perplexity import load_scoring_engine, perplexity

    _require_one_rank(args, ("",))
    text = read_text(args.text)
    max_length, stride = _windows(args, args.model)
    llm = load_scoring_engine(_scoring_config(args, args.model), max_length, args.chunk_tokens)
    token_ids = _encode(llm.engine.parts, text)
    result = perplexity(llm, token_ids, max_length, stride, progress=not args.no_progress)
    print(f"perplexity: {result.perplexity:.4f}  (mean NLL {result.mean_nll:.4f} nats over {result.num_tokens} "
          f"tokens, {result.num_windows} windows of {max_length} moving by {stride})")
    return {"model": args.model, "text": str(args.text), **result.to_dict()}


def _encode(parts: Any, text: str) -> list[int]:
    if parts.tokenizer is None:
        raise ValueError(f"{parts.model_dir} has no tokenizer; text cannot be scored without one")
    return parts.tokenizer.encode(text)


def _run_kl(args: argparse.Namespace) -> dict[str, Any]:
    from flashllm.eval.data import read_text
    from flashllm.eval.forward import load_scoring_parts
    from flashllm.eval.kl import compare_configs

    _require_one_rank(args, ("", "baseline_"))
    text = read_text(args.text)
    baseline_model = args.baseline_model or args.model
    max_length, stride = _windows(args, baseline_model)
    configs = {"baseline": _scoring_config(args, baseline_model, "baseline_"),
               "candidate": _scoring_config(args, args.model)}
    baseline = load_scoring_parts(configs["baseline"], max_length)
    candidate = load_scoring_parts(configs["candidate"], max_length)
    token_ids = _encode(baseline, text)
    result = compare_configs(baseline, candidate, token_ids, max_length, stride, progress=not args.no_progress,
                             chunk_tokens=args.chunk_tokens)
    print(f"KL(baseline || candidate): mean {result.mean_kl:.3e}  max {result.max_kl:.3e} nats over "
          f"{result.num_positions} positions\ntop-1 agreement: {result.top1_agreement:.2%}  relative logit error "
          f"{result.relative_logit_error:.3e}\n"
          f"perplexity: baseline {result.baseline_perplexity:.4f}  candidate {result.candidate_perplexity:.4f}")
    described = {name: dataclasses.asdict(c) for name, c in configs.items()}
    return {**described, "text": str(args.text), "max_length": max_length, "stride": stride,
            "chunk_tokens": args.chunk_tokens, **result.to_dict()}


def _run_rouge(args: argparse.Namespace) -> dict[str, Any]:
    from flashllm.eval.data import read_examples, read_predictions
    from flashllm.eval.rouge import make_scorer, rouge_scores

    examples = read_examples(args.data)
    make_scorer()  # fail on a missing rouge-score before any generation
    if args.predictions is not None:
        if args.reference is not None:
            raise ValueError("--reference generates with a model: give --model instead of --predictions")
        outputs = {"predictions": read_predictions(args.predictions)}
    else:
        outputs = _generate(args, [e.src for e in examples])
    references = [e.tgt for e in examples]
    scores = {name: rouge_scores(texts, references) for name, texts in outputs.items()}
    _print_rouge({name: s.mean for name, s in scores.items()})
    result: dict[str, Any] = {"data": str(args.data), "num_examples": len(examples),
                              "scores": {name: s.mean for name, s in scores.items()}}
    if "transformers" in scores:
        result["difference"] = {k: scores["flashllm"].mean[k] - scores["transformers"].mean[k]
                                for k in scores["flashllm"].mean}
    result["examples"] = [
        {"src": e.src, "tgt": e.tgt, **{name: texts[i] for name, texts in outputs.items()}}
        for i, e in enumerate(examples)
    ]
    return result


def _generate(args: argparse.Namespace, sources: list[str]) -> dict[str, list[str]]:
    from flashllm.eval.forward import parts_dtype
    from flashllm.eval.generation import generate_flashllm, generate_transformers, prompt_ids
    from flashllm.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, backend=args.backend, quant_type=args.quant_type,
              **parallel_options(args))
    if llm.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; ROUGE needs text prompts and outputs")
    use_template = not args.no_chat_template and llm.has_chat_template()
    prompts = [prompt_ids(llm, src, use_template) for src in sources]
    progress = not args.no_progress
    outputs = {"flashllm": generate_flashllm(llm, prompts, args.max_tokens, progress)}
    if args.save_predictions is not None:
        lines = (json.dumps({"prediction": t}, ensure_ascii=False) for t in outputs["flashllm"])
        args.save_predictions.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    if args.reference == "transformers":
        parts = llm.engine.parts
        outputs["transformers"] = generate_transformers(args.model, prompts, args.max_tokens, parts_dtype(parts),
                                                        llm.tokenizer, parts.eos_token_ids, progress)
    return outputs


def _print_rouge(means: dict[str, dict[str, float]]) -> None:
    names = list(means)
    header = f"{'':10}" + "".join(f"{n:>14}" for n in names)
    if len(names) == 2:
        header += f"{'difference':>14}"
    print(header)
    for rouge_type in next(iter(means.values())):
        row = [means[n][rouge_type] for n in names]
        cells = "".join(f"{v:14.2f}" for v in row) + (f"{row[0] - row[1]:+14.2f}" if len(row) == 2 else "")
        print(f"{rouge_type:10}{cells}")


def main(argv: list[str] | None = None) -> int:
    """`python -m flashllm.cli.eval ...`: the same command without the top-level `flashllm` parser."""
    parser = argparse.ArgumentParser(prog="flashllm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
