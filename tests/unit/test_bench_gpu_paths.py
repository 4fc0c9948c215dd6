"""The bench's device paths without a GPU: roofline plans and timing, the transformers baseline's device and OOM handling."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from flashllm.bench import hf_baseline, roofline
from flashllm.bench.workload import BenchRequest, parse_batch_sizes
from flashllm.cli import build_parser


def test_each_device_type_gets_its_plan() -> None:
    # the CPU keeps its sizes and its read-stream ceiling; a GPU gets docs/benchmarks.md's copy and an 8192^3 GEMM
    assert roofline.plan_for("cpu") == roofline.CPU_PLAN
    assert (roofline.CPU_PLAN.copy_bytes, roofline.CPU_PLAN.matmul_n, roofline.CPU_PLAN.repeats) == (1 << 30, 2048, 5)
    assert roofline.CPU_PLAN.ceiling == "read stream"
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        plan = roofline.plan_for(device)
        assert (plan.copy_bytes, plan.read_bytes, plan.matmul_n, plan.ceiling) == (2 << 30, 2 << 30, 8192, "copy")
        assert plan.repeats > 1 and plan.calls_per_timing > 1
        # only the CPU brackets each timed run with probes: a GPU's copy probe would need memory the KV cache holds
        assert roofline.CPU_PLAN.bracket_runs and not plan.bracket_runs


def test_the_ceiling_probe_measures_the_bandwidth_the_plan_divides_by(monkeypatch: pytest.MonkeyPatch) -> None:
    # buffers are recorded and made on meta; timings are faked: a copy's best timing at 1 s, and
    # a read's back-to-back timings 1 s each but the last, 6 s
    made: list[tuple[int, str]] = []
    real_ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda n, dtype, device: made.append((n * 4, device)) or real_ones(
        n, dtype=dtype, device="meta"))
    monkeypatch.setattr(roofline, "_fast_reads", lambda plan, num_bytes: {})
    monkeypatch.setattr(roofline, "_best_time", lambda fn, repeats, device, calls=1: 1.0)
    monkeypatch.setattr(roofline, "_timings", lambda fn, count, device, calls=1: [1.0] * (count - 1) + [6.0])
    # the CPU: its fastest read of 1 GiB, 1 s, is the ceiling; 10 reads over 15 s, the sustained rate
    assert roofline.CPU_PLAN.sustained_reads == 10
    assert (roofline.held_ceiling_probe("cpu")(), made) == ((1 << 30, 10 * (1 << 30) / 15), [(1 << 30, "cpu")])
    # without sustained reads, the fastest read is both
    made.clear()
    best = roofline.held_ceiling_probe("cpu", dataclasses.replace(roofline.CPU_PLAN, sustained_reads=0))
    assert best() == (1 << 30, 1 << 30)
    made.clear()
    # an accelerator: a 2 GiB copy, read + written bytes over its best time, is both
    assert (roofline.held_ceiling_probe("cuda:1")(), made) == ((2 * (2 << 30),) * 2, [(2 << 30, "cuda:1")])


def test_accelerator_timings_are_synchronized_and_divided_by_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device that is not the CPU (meta: shapes only, no work) every clock read follows a synchronize."""
    events: list[str] = []
    clock = iter(range(10_000))

    def fake_clock() -> float:
        events.append("clock")
        return float(next(clock))  # one second between consecutive reads

    monkeypatch.setattr(roofline, "perf_counter", fake_clock)
    monkeypatch.setattr(roofline, "synchronize", lambda device: events.append(f"sync {device}"))
    roof = roofline.measure(torch.bfloat16, "meta")
    plan = roofline.ACCELERATOR_PLAN
    assert events == ["sync meta", "clock", "sync meta", "clock"] * (3 * plan.repeats)
    seconds = 1.0 / plan.calls_per_timing
    assert roof.read_bandwidth == pytest.approx(plan.read_bytes / seconds)
    assert roof.copy_bandwidth == pytest.approx(2 * plan.copy_bytes / seconds)  # bytes read + written
    assert roof.matmul_flops == pytest.approx(2 * plan.matmul_n**3 / seconds)
    assert (roof.dtype, roof.ceiling, roof.bandwidth) == ("bfloat16", "copy", roof.copy_bandwidth)
    assert roof.decode_ceiling(2, 1000, 24) == pytest.approx(2 * roof.copy_bandwidth / 1024)


def test_cpu_ceiling_uses_the_read_stream() -> None:
    small = roofline.Plan(copy_bytes=1 << 20, read_bytes=1 << 20, matmul_n=64, repeats=2, calls_per_timing=1,
                          ceiling=roofline.CPU_PLAN.ceiling)
    roof = roofline.measure(torch.float32, "cpu", plan=small)
    assert roof.read_bandwidth > 0 and roof.copy_bandwidth > 0 and roof.matmul_flops > 0
    assert roof.bandwidth == roof.read_bandwidth
    assert roof.decode_ceiling(1, 4096) == pytest.approx(roof.read_bandwidth / 4096)


def test_the_read_bandwidth_is_the_fastest_of_the_plans_read_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    # the CPU plan adds the cpu backend's multi-stream reads to the torch sum, and the ceiling takes the
    # fastest; timings are faked: the torch sum (a tensor result) takes 1 s, the two-stream read 0.5 s,
    # the eight-stream read 0.25 s
    from flashllm.backends.cpu import native, read_probe

    if native.library() is None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    assert roofline.CPU_PLAN.fast_read == "flashllm.backends.cpu.read_probe:stream_reads"

    def fake_time(fn, repeats, device, calls=1) -> float:
        if isinstance(fn(), torch.Tensor):
            return 1.0
        return 0.5 if fn.args[1:] == read_probe.PATTERNS["two_stream_read"] else 0.25

    monkeypatch.setattr(roofline, "_best_time", fake_time)
    size = 1 << 20
    expected = {"torch.sum": size, "two_stream_read": 2 * size, "eight_stream_read": 4 * size}
    assert roofline.read_probes(size, 1, "cpu") == expected
    assert roofline.measure_read_bandwidth(size, 1, "cpu") == 4 * size
    roof = roofline.measure(torch.float32, "cpu", plan=roofline.Plan(
        copy_bytes=size, read_bytes=size, matmul_n=64, repeats=1, calls_per_timing=1, ceiling="read stream",
        fast_read=roofline.CPU_PLAN.fast_read))
    assert roof.read_bandwidth == 4 * size and dict(roof.read_probes) == expected


def test_a_held_probe_allocates_once_and_takes_the_faster_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # held for the probes around and inside one run: allocating 2 GiB per probe slowed the engine's
    # next chunk by 8% on `epyc3-2c`. Timings faked: torch.sum reads in 1 s each; the native reads
    # in 0.5 s, but one of their three reads takes 3 s, so their sustained rate (3/4 of the bytes per
    # second) falls below torch.sum's while their fastest read stays the higher: each is the higher of its kind
    from flashllm.backends.cpu import native

    if native.library() is None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(roofline, "_timings", lambda fn, count, device, calls=1: (
        [1.0] * count if isinstance(fn(), torch.Tensor) else [0.5] * (count - 1) + [3.0]))
    monkeypatch.setattr(roofline, "_best_time", lambda fn, repeats, device, calls=1: 1.0)
    size = 1 << 20
    plan = roofline.Plan(copy_bytes=size, read_bytes=size, matmul_n=64, repeats=1, calls_per_timing=1,
                         ceiling="read stream", fast_read=roofline.CPU_PLAN.fast_read, sustained_reads=3)
    allocations: list[str] = []
    real_ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, **k: allocations.append("ones") or real_ones(*a, **k))
    probe = roofline.held_ceiling_probe("cpu", plan)
    held = len(allocations)
    assert [probe(), probe()] == [(2 * size, size)] * 2
    assert held == 1 and len(allocations) == held  # no probe after the first allocates
    copy = roofline.held_ceiling_probe("cpu", dataclasses.replace(plan, ceiling="copy"))
    assert copy() == (2 * size / 1.0,) * 2  # read + written bytes over the copy's time


def test_a_sustained_read_is_timed_call_by_call_back_to_back() -> None:
    calls: list[int] = []
    times = roofline._timings(lambda: calls.append(1), 4, "cpu")
    assert len(calls) == 5 and len(times) == 4 and all(t >= 0 for t in times)  # one warm-up call, untimed


def test_a_plan_without_a_backend_read_probes_with_torch_alone() -> None:
    assert roofline.ACCELERATOR_PLAN.fast_read is None
    assert list(roofline.read_probes(1 << 20, 1, "meta")) == ["torch.sum"]


class FakeModel:
    """`generate` that records its inputs and runs out of memory above `max_batch` rows."""

    def __init__(self, device: str = "cpu", max_batch: int = 1 << 30) -> None:
        self.device, self.max_batch = torch.device(device), max_batch
        self.calls: list[tuple[torch.device, torch.device, tuple[int, ...], int]] = []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, **_: object) -> None:
        if input_ids.shape[0] > self.max_batch:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        self.calls.append((input_ids.device, attention_mask.device, tuple(input_ids.shape), max_new_tokens))


REQUESTS = [BenchRequest([5, 6, 7], 4), BenchRequest([8], 2), BenchRequest([9, 10], 3)]


def test_left_padded_aligns_prompts_right() -> None:
    ids, mask = hf_baseline.left_padded(REQUESTS[:2], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_static_batches_run_on_the_models_device() -> None:
    model = FakeModel("meta")  # not the CPU: inputs built on the host must be moved
    result = hf_baseline.run_static_batches(model, REQUESTS, batch_size=2)
    assert [(c[0].type, c[1].type) for c in model.calls] == [("meta", "meta")] * 2
    # each batch is as wide as its longest prompt and decodes to its longest output
    assert [(c[2], c[3]) for c in model.calls] == [((2, 3), 4), ((1, 2), 3)]
    assert (result.output_tokens, result.prompt_tokens) == (9, 6)


def test_load_puts_the_model_on_the_given_device(tmp_path) -> None:
    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "llama", "llama", seed=0, tokenizer=False)
    model = hf_baseline.load(model_dir, torch.float32, "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.device.type == "meta"


def test_a_batch_size_out_of_memory_is_recorded_and_the_others_run(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    freed: list[torch.device] = []
    monkeypatch.setattr(hf_baseline, "free_cached_memory", freed.append)
    model = FakeModel(max_batch=2)
    records = hf_baseline.run_batch_sizes(model, REQUESTS, [1, 4, 2])
    assert [r["batch_size"] for r in records] == [1, 4, 2]
    assert records[1] == {"batch_size": 4, "error": "out of memory"}
    assert all(r["output_tokens_per_s"] > 0 for r in (records[0], records[2]))
    assert freed == [model.device]
    assert "transformers batch 4 ran out of device memory (CUDA out of memory" in capsys.readouterr().err
    # the warm-up ran before any timed batch: a 2-token generate of a prompt as long as the first
    assert model.calls[0][2:] == ((1, 3), 2)


@pytest.mark.parametrize("max_batch", [2, 0])
def test_speedup_is_over_the_best_batch_that_ran(monkeypatch: pytest.MonkeyPatch, max_batch: int) -> None:
    from flashllm.bench import offline

    model = FakeModel(max_batch=max_batch)
    if max_batch == 0:  # even the warm-up's single row fails: let it through to test "every size failed"
        monkeypatch.setattr(hf_baseline, "warm_up", lambda *_: None)
    monkeypatch.setattr(hf_baseline, "load", lambda *_: model)
    args = argparse.Namespace(dtype="float32", baseline_batch_sizes=[1, 4, 2], mode="throughput", repeats=1)
    result: dict = {}
    rounds = [offline._transformers_round(args, None, REQUESTS, "cpu")]
    offline._transformers_record(args, rounds, [{"output_tokens_per_s": 1000.0}], result)
    ran = [r["output_tokens_per_s"] for r in result["transformers"] if "error" not in r]
    assert len(ran) == (2 if max_batch == 2 else 0)
    assert {"batch_size": 4, "error": "out of memory"} in result["transformers"]
    expected = 1000.0 / max(ran) if ran else None
    assert result["speedup_vs_best_transformers"] == (pytest.approx(expected) if ran else None)


def test_baseline_batch_sizes_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "throughput", "--baseline-batch-sizes", "64,128,256"])
    assert args.baseline_batch_sizes == [64, 128, 256]
    assert parser.parse_args(["bench", "latency"]).baseline_batch_sizes == [1, 16]
    for bad in ("0,2", "a", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "throughput", "--baseline-batch-sizes", bad])
        with pytest.raises(ValueError, match="positive integers"):
            parse_batch_sizes(bad)


def test_gpu_workload_lengths_parse() -> None:
    from flashllm.bench.shapes import SHAPES
    from flashllm.bench.workload import parse_range

    assert parse_range("100:1024") == (100, 1024)
    seven = SHAPES["qwen2.5-7b"]
    assert (seven["num_hidden_layers"], seven["hidden_size"], seven["num_attention_heads"],
            seven["num_key_value_heads"], seven["intermediate_size"], seven["vocab_size"],
            seven["tie_word_embeddings"]) == (28, 3584, 28, 4, 18944, 152064, False)


def test_the_warm_up_prompt_has_the_first_prompts_length_and_shares_no_position() -> None:
    # a 128-token prompt's first prefill compiled on the H100 inside the timed run while the
    # warm-up used 8 tokens (TTFT 1.29 s, then 0.03 s): the warm-up must be as long as the prompt
    from flashllm.bench.workload import warm_up_prompt

    request = BenchRequest([0, 1, 2, 151935, 7, 7, 0], 4)
    warm = warm_up_prompt(request)
    assert len(warm) == len(request.prompt_token_ids)
    assert all(w != p for w, p in zip(warm, request.prompt_token_ids, strict=True))
    assert 0 <= min(warm) and max(warm) <= max(request.prompt_token_ids)
