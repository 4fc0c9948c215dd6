"""The cpu backend's row-split decode matmuls: shares cover every row once and results match the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.cpu import parallel
from flashllm.backends.cpu.quant import choose_path, dense_matmul, dequant_matmul, run_path
from flashllm.ops.quant_matmul import QuantizedWeight, dequantize
from flashllm.ops.quant_matmul import quant_matmul as reference
from flashllm.quant import quantize_weight


@pytest.fixture
def three_threads():
    """Three shares even on a 2-core machine, so the pool path runs with more than one worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), parts=st.integers(1, 8))
def test_row_shares_cover_every_row_once_on_aligned_boundaries(n: int, parts: int) -> None:
    shares = parallel.row_shares(n, parts)
    assert shares[0][0] == 0 and shares[-1][1] == n
    assert all(end == nxt for (_, end), (nxt, _) in zip(shares, shares[1:], strict=False))
    assert all(start < end for start, end in shares)
    assert len(shares) <= parts
    assert all(start % parallel.ROW_ALIGN == 0 for start, _ in shares)


def test_split_decision_follows_tokens_size_and_threads(three_threads) -> None:
    assert parallel.should_split(1, 4096, 1024)
    assert not parallel.should_split(parallel.SPLIT_MAX_TOKENS + 1, 4096, 1024)  # a GEMM: BLAS threads it
    assert not parallel.should_split(1, 64, 64)                                   # too small to hand off
    torch.set_num_threads(1)
    assert not parallel.should_split(1, 4096, 1024)


@pytest.mark.parametrize("tokens,inference", [(1, False), (3, False), (1, True)])
def test_split_dense_matches_f_linear(three_threads, tokens: int, inference: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2100, 520, generator=gen)  # 2100 rows: shares of 704, 704, 692
    x, bias = torch.randn(tokens, 520, generator=gen), torch.randn(2100, generator=gen)
    assert parallel.should_split(tokens, *w.shape)
    with torch.inference_mode(inference):  # the engine runs under inference mode, which is per thread
        got = dense_matmul(x, QuantizedWeight.dense(w), bias)
    # the native kernel sums in another order than BLAS: hold it to the fp32 dot-product error bound
    # |err| <= K * 2**-24 * (|x| @ |w|.T) (+ the bias add), against a float64 product
    exact = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    bound = 520 * 2.0**-24 * (x.abs().double() @ w.abs().double().T + bias.abs().double())
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_split_rows_are_really_computed_by_several_threads(three_threads, monkeypatch) -> None:
    seen, calls = set(), []
    real = parallel.run_shares

    def spy(n, body):
        def recording(start, end):
            import threading

            seen.add(threading.get_ident())
            calls.append((start, end))
            body(start, end)

        real(n, recording)

    monkeypatch.setattr(parallel, "run_shares", spy)
    w = torch.randn(3000, 512)
    x = torch.randn(1, 512)
    torch.testing.assert_close(parallel.split_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3
    assert len(seen) >= 2  # the caller ran one share; a pool worker may run both others back to back


@pytest.mark.parametrize("scheme,group_size,symmetric", [("w8a16", -1, True), ("w4a16", 64, False)])
def test_split_dequant_matmul_matches_the_reference(three_threads, scheme, group_size, symmetric) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = quantize_weight(torch.randn(2100, 512, generator=gen), scheme, group_size, symmetric)
    x = torch.randn(2, 512, generator=gen)
    assert choose_path(weight, 2, packed_fast=False, native_ready=False) == "dequant"
    want = x @ dequantize(weight).T
    torch.testing.assert_close(dequant_matmul(x, weight), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run_path("dequant", x, weight), reference(x, weight), rtol=1e-4, atol=1e-4)


def test_an_exception_in_a_worker_share_reaches_the_caller(three_threads) -> None:
    def body(start: int, end: int) -> None:
        if start > 0:
            raise RuntimeError(f"share {start}:{end} failed")

    with pytest.raises(RuntimeError, match="share"):
        parallel.run_shares(3000, body)


def test_torch_single_threaded_keeps_the_split_width_and_restores(three_threads) -> None:
    assert parallel.workers() == 3
    with parallel.torch_single_threaded():
        assert torch.get_num_threads() == 1
        assert parallel.workers() == 3  # flashllm's own GEMV threads still use every core
        with parallel.torch_single_threaded():  # nested (engine step around the runner): no change
            assert torch.get_num_threads() == 1 and parallel.workers() == 3
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3 and parallel.workers() == 3
    with pytest.raises(RuntimeError), parallel.torch_single_threaded():
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == 3 and parallel.workers() == 3


def test_cpu_runner_single_threads_torch_for_decode_sized_steps_only(three_threads) -> None:
    from flashllm.backends.cpu import runner

    with runner.step_context(parallel.SPLIT_MAX_TOKENS):
        assert torch.get_num_threads() == 1
    with runner.step_context(parallel.SPLIT_MAX_TOKENS + 1):  # a prefill: BLAS GEMMs want the threads
        assert torch.get_num_threads() == 3


def test_engine_steps_run_in_the_cpu_runners_step_context(monkeypatch) -> None:
    from flashllm.backends.cpu import runner
    from flashllm.llm import LLM
    from flashllm.models.demo import demo_model_dir
    from flashllm.sampling_params import SamplingParams

    llm = LLM(str(demo_model_dir()), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8, block_size=16,
              num_scheduler_steps=1)
    assert isinstance(llm.engine.runner, runner.CpuRunner)
    seen = []
    real = runner.step_context
    monkeypatch.setattr(runner, "step_context", lambda n: seen.append(n) or real(n))
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    # each step twice (the step with its sampling, and its forward pass): a prefill, then decodes
    assert seen[:2] == [5, 5] and set(seen[2:]) == {1} and len(seen) == 6
