"""The transformers baseline: `generate` on the same weights and dtype, static padded batches."""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashllm.bench.roofline import synchronize
from flashllm.bench.workload import BenchRequest, warm_up_prompt


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
    """Wait for the model's queued device work before a clock is read (no-op on the CPU)."""
    synchronize(model.device)


def free_cached_memory(device: torch.device) -> None:
    """Collect dropped tensors and hand the caching allocator's free blocks back to the device."""
    gc.collect()
    module = torch.get_device_module(device.type) if device.type != "meta" else None
    if hasattr(module, "empty_cache"):  # accelerators cache freed blocks; the CPU allocator does not
        module.empty_cache()


def left_padded(chunk: list[BenchRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, longest prompt) int64 on `device`, prompts right-aligned.

    Built on the host and moved in one copy each, not one small copy per row.
    """
    width = max(len(r.prompt_token_ids) for r in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.long)  # (B, T)
    mask = torch.zeros(len(chunk), width, dtype=torch.long)  # (B, T)
    for row, r in enumerate(chunk):
        ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_static_batches(model, requests: list[BenchRequest], batch_size: int) -> BaselineResult:
    """Left-padded batches of `batch_size` in request order; each batch decodes to its longest output."""
    _sync(model)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i : i + batch_size]
        ids, mask = left_padded(chunk, model.device)
        new = max(r.output_len for r in chunk)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
    _sync(model)
    elapsed = time.perf_counter() - start
    return BaselineResult(batch_size, elapsed, sum(r.output_len for r in requests),
                          sum(len(r.prompt_token_ids) for r in requests))


@torch.inference_mode()
def warm_up(model, request: BenchRequest) -> None:
    """One 2-token generate of a prompt as long as `request`'s before any clock (flashllm gets the same):
    kernels, cuBLAS handles, allocator."""
    ids, mask = left_padded([BenchRequest(warm_up_prompt(request), 2)], model.device)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                   pad_token_id=0)
    _sync(model)


def run_batch_sizes(model, requests: list[BenchRequest], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """One record per static batch size; a size that runs out of device memory is recorded, not fatal.

    A record is {"batch_size", "elapsed_s", "output_tokens_per_s", "total_tokens_per_s"}, or
    {"batch_size", "error": "out of memory"} (the error's first line is printed to stderr). One run
    per size: `bench --repeats` calls this once per round (bench/offline.py).
    """
    warm_up(model, requests[0])
    records = []
    for batch in batch_sizes:
        message = None
        try:
            record = _batch_record(run_static_batches(model, requests, batch))
        except torch.OutOfMemoryError as exc:  # torch.cuda.OutOfMemoryError is this class
            message = (str(exc).splitlines() or ["out of memory"])[0]
        if message is not None:
            # outside the except block: its traceback kept the failed batch's tensors alive
            free_cached_memory(model.device)
            print(f"flashllm bench: transformers batch {batch} ran out of device memory ({message}); "
                  "recorded as an error, trying the next --baseline-batch-sizes", file=sys.stderr)
            records.append({"batch_size": batch, "error": "out of memory"})
            continue
        records.append(record)
    return records


def _batch_record(run: BaselineResult) -> dict[str, Any]:
    return {"batch_size": run.batch_size, "elapsed_s": run.elapsed, "output_tokens_per_s": run.output_throughput,
            "total_tokens_per_s": (run.output_tokens + run.prompt_tokens) / run.elapsed}


@dataclass(frozen=True, slots=True)
class LatencyResult:
    """Batch-1 latency of one request, from the time each token reached the host.

    token_times[i]: seconds from the generate call to token i (the first one ends the prefill).
    """

    token_times: tuple[float, ...]

    @property
    def ttft(self) -> float:
        return self.token_times[0]

    @property
    def total(self) -> float:
        return self.token_times[-1]

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time between the first and the last: never negative."""
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else float("nan")


class _TokenClock:
    """A transformers streamer that only notes when each generated token reaches the host.

    generate() hands the prompt to put() first, then every new token (moved to the CPU, so a
    device has finished computing it); the prompt's call is not a token.
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = time.perf_counter() - self.start
        self.times.extend([now] * (value.shape[-1] if value.dim() > 1 else 1))

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_latency(model, request: BenchRequest) -> LatencyResult:
    """One generate() of the request with a per-token clock: TTFT and the decode rate from its timestamps.

    (Differencing a one-token run and a full run, as before, could give a negative rate when the
    machine was busier during the short run.)
    """
    ids = torch.tensor([request.prompt_token_ids], device=model.device)

    def timed(new: int) -> LatencyResult:
        _sync(model)
        clock = _TokenClock(time.perf_counter())
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0, streamer=clock)
        return LatencyResult(tuple(clock.times))

    timed(2)  # warm-up: allocator, thread pool
    return timed(request.output_len)
