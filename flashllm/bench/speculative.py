"""`flashllm bench latency --speculate_method ...`: batch-1 decode with and without speculation in the same run,
the verify step's cost against a one-token step, and transformers' own prompt lookup as the baseline."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

# Copy-heavy chat prompts: the answer repeats, fixes or reformats text the prompt holds. The texts are long
# enough that a whole answer is the copy; it ends where the model ends it (end of text), never past it,
# since what a model writes after its answer under ignore_eos is not a copy workload.
COPY_TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix the spelling mistakes in this text and write out the corrected text in full:\n\n{text}",
    "Rewrite the following text as a bulleted list, one sentence per bullet, keeping every word:\n\n{text}",
    "Copy this code exactly as it is:\n\n{code}",
)
# Open questions: the prompt holds nothing to copy (--dataset chat), the guard's workload.
OPEN_TASKS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old how a refrigerator keeps food cold.",
    "Suggest five things to do with friends on a rainy Saturday afternoon, with a sentence on each.",
    "What are the main differences between a lake and a sea?",
)
_COPY_SENTENCES = 8  # per prompt: ~150-250 tokens of text to copy
# The code to copy: one coherent module (a model copies code it can read, not a jumble of unrelated lines).
_COPY_CODE = '''import json
from pathlib import Path


class Inventory:
    """Items and their counts, saved as JSON."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: dict[str, int] = {}

    def add(self, name: str, count: int = 1) -> int:
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]

    def remove(self, name: str) -> None:
        if name not in self.items:
            raise KeyError(f"no item named {name!r}")
        del self.items[name]

    def save(self) -> None:
        self.path.write_text(json.dumps(self.items, indent=2, sort_keys=True))
'''
_CHAT_DATASETS = ("copy", "chat", "sharegpt")  # prompts whose answers end at the model's end of text
_VERIFY_STEPS = 20  # timed steps per kind in the verify-cost measurement


def run_speculative(args: argparse.Namespace, model_dir: Path, speculative: dict[str, Any]) -> int:
    """Round-robin over --repeats rounds: the plain engine, the speculating engine, and (with --baseline
    transformers) transformers' prompt lookup decoding, each decoding every request at batch 1."""
    result: dict[str, Any] = {"mode": "latency", "model": str(model_dir), "dtype": args.dtype,
                              "speculative_config": speculative, "dataset": args.dataset,
                              "date": date.today().isoformat(), "machine": platform.processor() or platform.machine()}
    rounds: list[dict[str, Any]] = []
    requests: list[tuple[list[int], int]] = []
    for _ in range(args.repeats):
        plain, requests = _engine_run(args, model_dir, None, requests)
        spec, _ = _engine_run(args, model_dir, speculative, requests)
        entry = {"plain": plain, "speculative": spec}
        if "transformers" in (args.baseline or ()):
            lookup = int(speculative.get("num_speculative_tokens", 4))
            entry["transformers_prompt_lookup"] = _hf_generate(args, model_dir, requests, lookup)
            entry["transformers_plain"] = _hf_generate(args, model_dir, requests, None)
        rounds.append(entry)
    result["num_requests"] = len(requests)
    result["rounds"] = rounds
    ratios = [r["speculative"]["decode_tokens_per_s"] / r["plain"]["decode_tokens_per_s"] for r in rounds]
    result["speedup_vs_plain"] = statistics.median(ratios)
    result["verify_step_cost"] = statistics.median(r["speculative"]["verify_step_cost"] for r in rounds)
    if "transformers" in (args.baseline or ()):
        result["speedup_vs_transformers_prompt_lookup"] = statistics.median(
            r["speculative"]["decode_tokens_per_s"] / r["transformers_prompt_lookup"]["decode_tokens_per_s"]
            for r in rounds)
        result["transformers_prompt_lookup_speedup"] = statistics.median(
            r["transformers_prompt_lookup"]["decode_tokens_per_s"] / r["transformers_plain"]["decode_tokens_per_s"]
            for r in rounds)
    result["request_speedups"] = [  # per request (for copy: COPY_TASKS in turn), median over rounds
        statistics.median(r["speculative"]["request_tokens_per_s"][i] / r["plain"]["request_tokens_per_s"][i]
                          for r in rounds) for i in range(len(requests))]
    result["speedup_method"] = "median over rounds of the ratio within a round (each round runs every engine once)"
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _engine_run(args: argparse.Namespace, model_dir: Path, speculative: dict[str, Any] | None,
                requests: list[tuple[list[int], int]]) -> tuple[dict[str, Any], list[tuple[list[int], int]]]:
    """Every request alone (batch 1), greedy, its full output length: decode tokens/s over all of them."""
    from flashllm.llm import LLM
    from flashllm.sampling_params import SamplingParams

    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, backend=args.backend,
              max_model_len=args.max_model_len, num_scheduler_steps=args.num_scheduler_steps,
              speculative_config=speculative)
    requests = requests or _requests(args, llm)
    llm.generate([requests[0][0][:8]], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up
    per_request = []
    for prompt, output_len in requests:
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=args.dataset not in _CHAT_DATASETS,
                                detokenize=False)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        per_request.append((len(out.outputs[0].token_ids) - 1, out.metrics.latency - out.metrics.time_to_first_token))
    decode_tokens, decode_s = sum(n for n, _ in per_request), sum(t for _, t in per_request)
    record: dict[str, Any] = {"decode_tokens_per_s": decode_tokens / decode_s, "decode_tokens": decode_tokens,
                              "request_tokens_per_s": [n / t for n, t in per_request]}
    speculator = llm.engine.speculator
    if speculator is not None:
        stats = speculator.stats
        record.update(acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
                      drafted=stats.num_drafted, accepted=stats.num_accepted,
                      verify_step_cost=verify_step_cost(llm, speculator.config.num_speculative_tokens),
                      guard_min_acceptance=speculator.min_acceptance)
    del llm
    gc.collect()
    return record, requests


def verify_step_cost(llm: Any, drafts: int) -> float:
    """Median time of a verify step (one sequence: its token + `drafts` drafted tokens) over the median time of
    a one-token decode step of the same sequence, both through the engine's executor on the same blocks."""
    from flashllm.core.spec.costs import measure_round

    costs = measure_round(llm.engine, drafts, repeats=_VERIFY_STEPS)
    return costs.verify_step_cost if costs is not None else float("nan")


def _requests(args: argparse.Namespace, llm: Any) -> list[tuple[list[int], int]]:
    """(prompt tokens, output length) pairs: chat prompts of COPY_TASKS (--dataset copy, needs a tokenizer and a
    chat template) or OPEN_TASKS (chat), a ShareGPT file's first turns with their replies' lengths (sharegpt),
    else random tokens (nothing to copy)."""
    from flashllm.bench.workload import parse_range, random_requests, sharegpt_file_requests

    if args.dataset == "sharegpt":
        return [(r.prompt_token_ids, r.output_len) for r in sharegpt_file_requests(args, llm.tokenizer)]
    output_len = parse_range(args.output_len)[1]
    if args.dataset == "copy":
        return [(prompt, output_len) for prompt in copy_prompts(llm, args.num_prompts)]
    if args.dataset == "chat":
        return [(prompt, output_len) for prompt in open_prompts(llm, args.num_prompts)]
    vocab = llm.engine.parts.hf_config.vocab_size
    return [(r.prompt_token_ids, r.output_len)
            for r in random_requests(args.num_prompts, parse_range(args.input_len), (output_len, output_len), vocab,
                                     args.seed)]


def copy_prompts(llm: Any, count: int) -> list[list[int]]:
    """Token ids of `count` chat prompts (the model's template) asking to repeat, fix or reformat a text of the
    local corpus or a short Python module: COPY_TASKS in turn, each over other sentences."""
    from flashllm.testing.corpus import CORPUS

    prose = [line for line in CORPUS if line.endswith(".") and len(line) > 40]
    prompts = []
    for i in range(count):
        text = " ".join(prose[(i * _COPY_SENTENCES + j) % len(prose)] for j in range(_COPY_SENTENCES))
        task = COPY_TASKS[i % len(COPY_TASKS)].format(text=text, code=_COPY_CODE)
        prompts.append(llm.render_chat([{"role": "user", "content": task}]))
    return prompts


def open_prompts(llm: Any, count: int) -> list[list[int]]:
    """Token ids of `count` chat prompts asking open questions (OPEN_TASKS in turn): nothing to copy."""
    return [llm.render_chat([{"role": "user", "content": OPEN_TASKS[i % len(OPEN_TASKS)]}]) for i in range(count)]


def _hf_generate(args: argparse.Namespace, model_dir: Path, requests: list[tuple[list[int], int]],
                 lookup: int | None) -> dict[str, Any]:
    """transformers' greedy generate at batch 1 on the same weights, with prompt_lookup_num_tokens=lookup (its
    n-gram lookup) or without (lookup None): decode tokens/s over the requests (the first token's time,
    prefill included, left out). Copy prompts end at the model's end of text, as flashllm's do."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    extra: dict[str, Any] = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
    decode_s, decode_tokens = 0.0, 0
    with torch.inference_mode():
        for prompt, output_len in requests:
            ids = torch.tensor([prompt])
            least = 1 if args.dataset in _CHAT_DATASETS else output_len
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=least, do_sample=False, **extra)
            total = time.perf_counter() - start
            decode_s += max(total - first, 1e-9)
            decode_tokens += out.shape[1] - len(prompt) - 1
    del model
    gc.collect()
    return {"decode_tokens_per_s": decode_tokens / decode_s, "decode_tokens": decode_tokens, **extra}
