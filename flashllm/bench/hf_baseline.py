"""The transformers baseline: `generate` on the same weights and dtype, static padded batches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashllm.bench.workload import BenchRequest


@dataclass(frozen=True, slots=True)
class BaselineResult:
    batch_size: int
    elapsed: float
    output_tokens: int  # tokens the requests asked for (padding work in a static batch is not counted)
    prompt_tokens: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed


def load(model_dir: Path, dtype: torch.dtype, device: str = "cpu"):
    """The transformers model on `device` (the device flashllm ran on, so both run on the same hardware)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def _sync(model) -> None:
    """Wait for queued GPU work before a clock is read (CUDA launches return before they finish)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


@torch.inference_mode()
def run_static_batches(model, requests: list[BenchRequest], batch_size: int) -> BaselineResult:
    """Left-padded batches of `batch_size` in request order; each batch decodes to its longest output."""
    _sync(model)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, r in enumerate(chunk):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in chunk)
        model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync(model)
    elapsed = time.perf_counter() - start
    return BaselineResult(batch_size, elapsed, sum(r.output_len for r in requests),
                          sum(len(r.prompt_token_ids) for r in requests))


@dataclass(frozen=True, slots=True)
class LatencyResult:
    """Batch-1 latency of one request: time to the first token and the decode rate after it."""

    ttft: float
    total: float
    output_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.output_tokens - 1) / (self.total - self.ttft)


@torch.inference_mode()
def run_latency(model, request: BenchRequest) -> LatencyResult:
    """generate() of one request twice: one new token (the prefill), then all of them.

    The decode rate is (output_len - 1) / (full time - one-token time); a generate call's fixed
    cost cancels in the difference.
    """
    ids = torch.tensor([request.prompt_token_ids], device=model.device)

    def timed(new: int) -> float:
        _sync(model)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
        _sync(model)
        return time.perf_counter() - start

    timed(2)  # warm-up: allocator, thread pool
    ttft = timed(1)
    return LatencyResult(ttft, timed(request.output_len), request.output_len)
