"""The transformers latency baseline times every token: TTFT and a decode rate that cannot be negative."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.bench.hf_baseline import LatencyResult, run_latency
from flashllm.bench.workload import BenchRequest
from flashllm.testing.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")


def test_every_generated_token_gets_a_timestamp_in_order(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path, "llama", seed=1, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    request = BenchRequest(list(range(3, 19)), 12)
    run = run_latency(model, request)
    assert run.output_tokens == request.output_len  # one timestamp per generated token, the prompt none
    assert list(run.token_times) == sorted(run.token_times) and run.token_times[0] > 0
    assert run.ttft == run.token_times[0] and run.total == run.token_times[-1]
    assert run.decode_tokens_per_s == pytest.approx(11 / (run.total - run.ttft))


@pytest.mark.parametrize("times", [(0.5, 0.6, 0.9), (2.0, 2.0001), (0.1, 0.1, 0.1)])
def test_the_decode_rate_is_positive_or_undefined_never_negative(times: tuple[float, ...]) -> None:
    rate = LatencyResult(times).decode_tokens_per_s
    assert rate > 0 or rate != rate  # NaN when every token arrived at once
