"""The llama.cpp baseline: llama-cpp-python on a GGUF converted from the same weights, one sequence at a time."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashllm.bench.repeats import Probe, bracketed_run, chunked_record, probed_decode, times_in_chunks
from flashllm.bench.workload import BenchRequest, warm_up_prompt

INSTALL_HINT = ("pip install llama-cpp-python gguf (llama-cpp-python builds llama.cpp from source with cmake; "
                "it takes minutes)")
# GGUF file type matching each benchmark dtype, so both engines read weights of the same width.
GGUF_TYPE_FOR_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python or gguf is not importable; the message is one line naming the install command."""


@dataclass(slots=True)
class LlamaCppResult:
    """Timings of greedy generation of every request, one after another (batch 1).

    ttfts[i]: seconds from the start of request i to its first token (prefill + one sample);
    decode_s[i]: seconds spent on its remaining output_len - 1 tokens.
    """

    elapsed: float
    prompt_tokens: int
    output_tokens: int
    ttfts: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def record(self) -> dict[str, float | int]:
        """The JSON record, with the keys of a transformers baseline run plus latency numbers."""
        decoded = sum(len(t) - 1 for t in self.token_ids)
        numbers: dict[str, float | int] = {
            "batch_size": 1, "elapsed_s": self.elapsed, "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens / self.elapsed,
            "total_tokens_per_s": (self.output_tokens + self.prompt_tokens) / self.elapsed,
            "mean_ttft_s": sum(self.ttfts) / len(self.ttfts),
        }
        if decoded and sum(self.decode_s) > 0:
            numbers["decode_tokens_per_s"] = decoded / sum(self.decode_s)
        return numbers


def require_llama_cpp() -> Any:
    """The llama_cpp module (and gguf, which the export needs), or LlamaCppUnavailable."""
    try:
        import gguf  # noqa: F401
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppUnavailable(f"the llama.cpp baseline needs {exc.name}, which is not installed; "
                                  f"run: {INSTALL_HINT}") from exc
    return llama_cpp


def num_cores() -> int:
    """CPU cores this process may run on (the thread count llama.cpp gets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load(gguf_path: Path, n_ctx: int, n_batch: int, n_threads: int | None = None) -> Any:
    """A `llama_cpp.Llama` over `gguf_path`: CPU threads = cores, last-token logits only, quiet."""
    llama_cpp = require_llama_cpp()
    threads = n_threads or num_cores()
    return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                           n_threads_batch=threads, logits_all=False, verbose=False)


def greedy_generate(llm: Any, prompt_token_ids: list[int], output_len: int) -> tuple[list[int], float, float]:
    """Exactly `output_len` greedy tokens after the prompt, EOS ignored, with a fresh KV cache.

    Returns (token_ids, ttft_s, total_s). The prompt is evaluated once (prefill), then one forward
    pass per token but the last, the same work flashllm does for the request.
    """
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    start = time.perf_counter()
    steps = greedy_tokens(llm, prompt_token_ids, output_len)
    tokens = [next(steps)]
    ttft = time.perf_counter() - start
    tokens.extend(steps)
    return tokens, ttft, time.perf_counter() - start


def greedy_tokens(llm: Any, prompt_token_ids: list[int], output_len: int) -> Iterator[int]:
    """greedy_generate's tokens one at a time, each computed when asked for (the first by the prefill)."""
    llm.reset()  # never reuse a previous request's cache: each request pays its own prefill
    llm.eval(prompt_token_ids)
    token = _greedy(llm)
    yield token
    for _ in range(output_len - 1):
        llm.eval([token])
        token = _greedy(llm)
        yield token


def _greedy(llm: Any) -> int:
    # temp 0 makes llama.cpp's sampler chain an argmax; repeat_penalty 1 keeps the penalties a no-op
    return int(llm.sample(temp=0.0, top_k=1, repeat_penalty=1.0))


def run_requests(llm: Any, requests: list[BenchRequest]) -> LlamaCppResult:
    """Generate every request in order (llama-cpp-python's API serves one sequence at a time)."""
    start = time.perf_counter()
    result = LlamaCppResult(0.0, sum(len(r.prompt_token_ids) for r in requests), 0)
    for request in requests:
        tokens, ttft, total = greedy_generate(llm, request.prompt_token_ids, request.output_len)
        result.token_ids.append(tokens)
        result.ttfts.append(ttft)
        result.decode_s.append(total - ttft)
    result.elapsed = time.perf_counter() - start
    result.output_tokens = sum(len(t) for t in result.token_ids)
    return result


def run_baseline(model_dir: Path, requests: list[BenchRequest], file_type: str = "f32",
                 cache_dir: Path | None = None, n_threads: int | None = None,
                 probe: Probe | None = None, probe_every: int = 0) -> dict[str, Any]:
    """Convert (or reuse) the GGUF of `model_dir`, warm up, run `requests`; returns the JSON record.

    The record carries the transformers baseline's keys (batch_size, elapsed_s, output_tokens_per_s)
    plus output_tokens, total_tokens_per_s, mean_ttft_s, decode_tokens_per_s and the GGUF used.
    probe: bracket the timed run with it (bench/repeats.py); with probe_every and a single request,
    also probe between every probe_every decode tokens (repeats.probed_decode). One run per call:
    `bench --repeats` calls this once per round (bench/offline.py).
    """
    llama_cpp = require_llama_cpp()
    from flashllm.bench.gguf_export import cached_gguf

    gguf_path = cached_gguf(model_dir, file_type, cache_dir)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    n_batch = max(32, min(2048, max(len(r.prompt_token_ids) for r in requests)))
    llm = load(gguf_path, n_ctx=max(longest, n_batch), n_batch=n_batch, n_threads=n_threads)
    try:
        greedy_generate(llm, warm_up_prompt(requests[0]), 2)  # untimed, as flashllm gets
        if times_in_chunks(probe, probe_every, requests):
            request = requests[0]
            run = probed_decode(greedy_tokens(llm, request.prompt_token_ids, request.output_len),
                                request.output_len - 1, probe, probe_every)
            record = {"batch_size": 1, **chunked_record(run, len(request.prompt_token_ids))}
        else:
            record = bracketed_run(lambda: run_requests(llm, requests).record(), probe)
    finally:
        llm.close()  # frees the model and KV cache before anything else is measured
    record.update({"gguf": str(gguf_path), "gguf_type": file_type, "n_threads": n_threads or num_cores(),
                   "llama_cpp_version": getattr(llama_cpp, "__version__", "unknown")})
    return record

