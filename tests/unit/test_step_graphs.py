"""Decode graphs' input staging on the CPU: a fake graph whose replay re-runs the recorded step.

A real CUDA graph replays the captured kernels on whatever the static input buffers hold. The
fake below does the same thing the slow way: its replay calls the step function it saw during
capture, which reads the same buffers. So these tests check everything DecodeGraphs does around
the graph (padding rows, stale block-table entries, batch-size choice, the shared logits buffer,
falling back to eager steps) against the eager engine; the GPU test in tests/gpu checks the
graphs themselves.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from flashllm.backends.cpu import CpuAdapter
from flashllm.core import step_graphs
from flashllm.core.step_graphs import DecodeGraphs, graph_batch_sizes
from flashllm.llm import LLM
from flashllm.registry.backend import StepGraph
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model


class RerunGraph(StepGraph):
    """Replays by calling again the step run inside capture()."""

    recording: RerunGraph | None = None

    def __init__(self) -> None:
        self.step: Any = None
        self.replays = 0

    @contextmanager
    def capture(self, pool: Any = None):
        RerunGraph.recording = self
        try:
            yield
        finally:
            RerunGraph.recording = None

    def pool(self) -> Any:
        return None

    def replay(self) -> None:
        self.replays += 1
        self.step()


@pytest.fixture
def rerun_graphs(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[DecodeGraphs]]:
    """CpuAdapter offers RerunGraphs, and DecodeGraphs steps register themselves with the recording one."""
    made: dict[str, list[DecodeGraphs]] = {"graphs": []}
    original_step = DecodeGraphs._step
    original_init = DecodeGraphs.__init__

    def step(self: DecodeGraphs, batch: int) -> None:
        if RerunGraph.recording is not None:
            RerunGraph.recording.step = lambda: original_step(self, batch)
        original_step(self, batch)

    def init(self: DecodeGraphs, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        made["graphs"].append(self)

    monkeypatch.setattr(DecodeGraphs, "_step", step)
    monkeypatch.setattr(DecodeGraphs, "__init__", init)
    monkeypatch.setattr(CpuAdapter, "new_graph", lambda self, device: RerunGraph())
    return made


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=11, tokenizer=False)


PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], [9, 4, 4, 4, 2, 61, 3, 3, 30, 2, 1]]


def _generate(model_dir: Path, **kwargs: Any) -> tuple[LLM, list[list[int]], list[list[float]]]:
    llm = LLM(str(model_dir), backend="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              **kwargs)
    # different lengths: sequences finish at different steps, so the batch shrinks between graph sizes
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in (24, 9, 30, 17)]
    outputs = llm.generate(PROMPTS, params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [list(o.outputs[0].logprobs) for o in outputs]  # the chosen tokens' logprobs
    return llm, tokens, logprobs


def test_ladder_covers_every_batch_size() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    for n in range(1, 70):
        assert max(graph_batch_sizes(n)) == n


def test_replayed_decode_steps_give_the_eager_tokens_and_logprobs(
    model_dir: Path, rerun_graphs: dict[str, list[DecodeGraphs]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLASHLLM_CPU_FUSED_DECODE", "0")  # the eager side runs the same model forward
    _, eager_tokens, eager_logprobs = _generate(model_dir, enforce_eager=True)
    assert rerun_graphs["graphs"] == []  # --enforce-eager: nothing captured
    llm, tokens, logprobs = _generate(model_dir, max_num_seqs=3)
    (graphs,) = rerun_graphs["graphs"]
    assert graphs.batch_sizes == [1, 2, 3]
    assert sorted(graphs.graphs) == [1, 2, 3]
    replays = {size: graph.replays for size, graph in graphs.graphs.items()}
    # 4 prompts, 3 at a time: full and shrinking batches both replayed; prefills ran eagerly
    assert replays[3] > 0 and replays[2] > 0 and replays[1] > 0
    assert tokens == eager_tokens
    for got, want in zip(logprobs, eager_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    assert llm.engine.runner.graphs is graphs


def test_padding_rows_write_nothing_to_the_kv_cache(
    model_dir: Path, rerun_graphs: dict[str, list[DecodeGraphs]]
) -> None:
    llm = LLM(str(model_dir), backend="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              max_num_seqs=4)
    (graphs,) = rerun_graphs["graphs"]
    before = [t.clone() for layer in llm.engine.runner.kv_caches for t in layer]
    # three real sequences in the batch-of-4 graph: row 3 is padding with slot -1
    with torch.inference_mode():  # as the model runner calls it
        logits = graphs.run([5, 6, 7], [3, 1, 0], [4 * 7 + 3, 4 * 8 + 1, 4 * 9], [4, 2, 1], [[9, 7], [8], [9]])
    assert logits.shape[0] == 3 and graphs.graphs[4].replays == 1
    after = [t for layer in llm.engine.runner.kv_caches for t in layer]
    changed = {tuple(i.tolist()) for b, a in zip(before, after, strict=True)
               for i in (b != a).any(-1).any(-1).nonzero()}
    assert changed == {(7, 3), (8, 1), (9, 0)}  # the real rows' slots and nothing else


def test_steps_a_graph_cannot_hold_run_eagerly(model_dir: Path, rerun_graphs: dict[str, list[DecodeGraphs]]) -> None:
    _generate(model_dir, max_num_seqs=3)
    (graphs,) = rerun_graphs["graphs"]
    assert graphs.fits(3, graphs.max_blocks)
    assert not graphs.fits(4, 1)  # more sequences than the largest graph
    assert not graphs.fits(1, graphs.max_blocks + 1)  # a table wider than max_model_len allows
    assert not graphs.fits(0, 1)


def test_reference_kernels_that_read_the_host_keep_steps_eager(
    model_dir: Path, rerun_graphs: dict[str, list[DecodeGraphs]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="flashllm.core.builder")
    llm = LLM(str(model_dir), backend="reference", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64)
    assert llm.engine.runner.graphs is None and rerun_graphs["graphs"] == []
    assert step_graphs.PAD_SLOT == -1


def test_only_the_kernels_a_model_binds_decide_whether_it_can_be_captured(model_dir: Path) -> None:
    from flashllm.core.builder import bound_ops

    llm = LLM(str(model_dir), backend="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64)
    bound = set(bound_ops(llm.engine.runner.model, llm.engine.parts.ops))
    assert {"rms_norm", "rotary_embedding", "paged_attention", "write_kv_cache", "quant_matmul"} <= bound
    assert "fused_moe" not in bound  # a Llama calls no MoE kernel, so a host-reading one does not stop its graphs
    assert not llm.engine.parts.ops.kernel("fused_moe").caps.graph_safe
