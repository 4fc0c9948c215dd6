"""Benchmark requests: random lengths (docs/benchmarks.md) or a ShareGPT-layout JSON file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def warm_up_prompt(request: BenchRequest) -> list[int]:
    """A prompt as long as `request`'s that shares no token position with it, for the untimed
    warm-up every engine gets: the first prefill of a length compiles and sizes what that length
    picks (Triton specialisations, buffers), yet no prefix-cache block of the timed run is filled.

    Every id moves down by one (0 moves to 1), so the result stays inside the vocabulary."""
    return [t - 1 if t else 1 for t in request.prompt_token_ids]


def parse_range(text: str) -> tuple[int, int]:
    """"32:256" -> (32, 256); "128" -> (128, 128)."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}: expected A or A:B with 1 <= A <= B")
    return lo, hi


def parse_batch_sizes(text: str) -> list[int]:
    """"1,16,64" -> [1, 16, 64]: the static batch sizes of a baseline, in the order they run."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"bad batch sizes {text!r}: expected positive integers separated by commas, e.g. 1,16,64")
    return sizes


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                    seed: int = 0) -> list[BenchRequest]:
    """`num` requests with lengths uniform in the ranges and random prompt token ids."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        requests.append(BenchRequest([rng.randrange(vocab) for _ in range(n_in)], n_out))
    return requests


def sharegpt_file_requests(args: Any, tokenizer: Any) -> list[BenchRequest]:
    """sharegpt_requests from the bench's --dataset-path, --num-prompts and --seed; SystemExit without a file."""
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path FILE")
    return sharegpt_requests(Path(args.dataset_path), tokenizer, args.num_prompts, seed=args.seed)


def sharegpt_requests(path: Path, tokenizer, num: int, max_len: int = 2048, seed: int = 0) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's token count as the output length (ShareGPT layout:
    a list of {"conversations": [{"from": "human"|"gpt", "value": ...}, ...]})."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    rng = random.Random(seed)
    rng.shuffle(data)
    requests = []
    for item in data:
        turns = item.get("conversations", [])
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt = tokenizer.encode(turns[0]["value"])
        output_len = len(tokenizer.encode(turns[1]["value"]))
        if 4 <= len(prompt) and 4 <= output_len and len(prompt) + output_len <= max_len:
            requests.append(BenchRequest(prompt, output_len))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path} has no usable ShareGPT conversations (need human then gpt turns)")
    return requests
