"""Shape buckets on the CPU: a padded batch gives the unpadded batch's logits and KV cache, step by step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashllm.backends import xla
from flashllm.core.model_runner import PAD_SLOT, ModelRunner
from flashllm.core.scheduler import ScheduledSequence, SchedulerOutput
from flashllm.core.sequence import Sequence
from flashllm.models.loader import load_model
from flashllm.models.registry import ModelRegistry
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import DeviceAdapter, ShapeBuckets, next_bucket
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.resolve import OpTable
from flashllm.testing.tiny_models import build_tiny_model

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 48
# small minimums so every step below really pads tokens, sequences and block-table width
BUCKETS = ShapeBuckets(min_tokens=4, min_seqs=2, min_blocks=2)
PROMPTS = ([5, 9, 2, 7, 1, 3, 3, 8, 6], [4, 4, 1], [7, 2, 9, 9, 1, 5, 6, 2, 8, 3, 3, 1, 4, 6])
# tokens each sequence runs per step (0 = not scheduled): full prefill, chunked prefill, decodes
PLAN = ((9, 2, 6), (1, 1, 8), (1, 1, 1), (0, 1, 1), (1, 1, 1))


class BucketAdapter(DeviceAdapter):
    """A CPU adapter asking for BUCKETS and counting end_step calls."""

    shape_buckets = BUCKETS

    def __init__(self) -> None:
        super().__init__("cpu")
        self.steps = 0

    def end_step(self, device: torch.device) -> None:
        self.steps += 1


@given(n=st.integers(0, 5000), minimum=st.integers(1, 300))
def test_next_bucket_is_the_smallest_allowed_size(n: int, minimum: int) -> None:
    bucket = next_bucket(n, minimum)
    assert bucket >= n and bucket >= minimum
    allowed = [minimum] + [2**k for k in range(14) if 2**k > minimum]
    assert bucket == min(size for size in allowed if size >= n)


def test_bucket_minimums_must_be_positive() -> None:
    with pytest.raises(ValueError, match="min_seqs must be >= 1"):
        ShapeBuckets(min_seqs=0)


@dataclass
class Run:
    logits: list[torch.Tensor]
    inputs: list


def run_plan(runner: ModelRunner, plan: tuple[tuple[int, ...], ...] = PLAN) -> Run:
    """Drive `runner` through `plan` by hand: greedy tokens are appended, blocks come from a shuffled pool."""
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    seqs = [Sequence(f"r{i}", prompt) for i, prompt in enumerate(PROMPTS)]
    run = Run([], [])
    for step in plan:
        batch = SchedulerOutput()
        for seq, n in zip(seqs, step, strict=True):
            if n == 0:
                continue
            while len(seq.block_table) * BLOCK_SIZE < seq.num_computed_tokens + n:
                seq.block_table.append(pool.pop())
            done = seq.num_computed_tokens + n == len(seq.token_ids)
            batch.scheduled.append(ScheduledSequence(seq, n, done))
        run.inputs.append(runner.prepare(batch))
        logits = runner.execute_model(batch)
        run.logits.append(logits)
        rows = iter(logits.argmax(dim=-1).tolist())
        for item in batch.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.produces_token:
                item.seq.append_token(next(rows))
    return run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("buckets"), "llama", seed=5, tokenizer=False)


def _model(model_dir: Path, backend: str) -> torch.nn.Module:
    plugins = make_plugin_manager(load_entry_points=False)
    registry = ModelRegistry()
    for architecture, target in plugins.model_targets().items():
        registry.register(architecture, target)
    kernels = {op: ks[0] for op, ks in plugins.backends()[backend].kernels.items()}
    model, _ = load_model(model_dir, OpTable(kernels, []), torch.float32, CPU, registry, progress=False)
    return model


@pytest.fixture(scope="module")
def unpadded(model_dir: Path) -> tuple[ModelRunner, Run]:
    runner = ModelRunner(_model(model_dir, "reference"), CPU, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    return runner, run_plan(runner)


def test_default_runner_does_not_pad(unpadded: tuple[ModelRunner, Run]) -> None:
    runner, run = unpadded
    assert runner.shape_buckets is None
    for step, inputs in zip(PLAN, run.inputs, strict=True):
        lens = [n for n in step if n]
        assert inputs.input_ids.shape[0] == sum(lens) and inputs.num_logits is None
        assert inputs.attn_metadata.cu_seqlens_q.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
        assert (inputs.attn_metadata.slot_mapping >= 0).all()


def test_padded_shapes_are_buckets(unpadded: tuple[ModelRunner, Run], model_dir: Path) -> None:
    runner = ModelRunner(_model(model_dir, "reference"), CPU, NUM_BLOCKS, BLOCK_SIZE, torch.float32,
                         adapter=BucketAdapter())
    run = run_plan(runner)
    for plain, padded in zip(unpadded[1].inputs, run.inputs, strict=True):
        num_tokens, meta = plain.input_ids.shape[0], plain.attn_metadata
        num_seqs, width = meta.seq_lens.shape[0], meta.block_tables.shape[1]
        assert padded.input_ids.shape[0] == next_bucket(num_tokens, BUCKETS.min_tokens)
        assert padded.attn_metadata.seq_lens.shape[0] == next_bucket(num_seqs, BUCKETS.min_seqs)
        assert padded.attn_metadata.block_tables.shape == (next_bucket(num_seqs, BUCKETS.min_seqs),
                                                           next_bucket(width, BUCKETS.min_blocks))
        assert padded.logits_indices.shape[0] == next_bucket(num_seqs, BUCKETS.min_seqs)
        assert padded.num_logits == plain.logits_indices.shape[0]
        # the real part is the unpadded batch; padding writes no KV and adds no query tokens
        assert torch.equal(padded.input_ids[:num_tokens], plain.input_ids)
        assert torch.equal(padded.attn_metadata.slot_mapping[:num_tokens], meta.slot_mapping)
        assert (padded.attn_metadata.slot_mapping[num_tokens:] == PAD_SLOT).all()
        assert torch.equal(padded.attn_metadata.cu_seqlens_q[: num_seqs + 1], meta.cu_seqlens_q)
        assert (padded.attn_metadata.cu_seqlens_q[num_seqs:] == num_tokens).all()
        assert torch.equal(padded.attn_metadata.block_tables[:num_seqs, :width], meta.block_tables)
        assert torch.equal(padded.logits_indices[: padded.num_logits], plain.logits_indices)
        assert (padded.attn_metadata.max_seqlen_q, padded.attn_metadata.max_seqlen_k) == (
            meta.max_seqlen_q, meta.max_seqlen_k)


@pytest.mark.parametrize("backend", ["reference", "cpu", "xla"])
def test_padded_steps_give_the_unpadded_logits_and_cache(
    unpadded: tuple[ModelRunner, Run], model_dir: Path, backend: str
) -> None:
    """Reference, cpu and the xla kernels (plain torch, run here on the CPU) over bucketed batches."""
    plain_runner, plain = unpadded
    adapter = BucketAdapter()
    runner = ModelRunner(_model(model_dir, backend), CPU, NUM_BLOCKS, BLOCK_SIZE, torch.float32, adapter=adapter)
    padded = run_plan(runner)
    assert adapter.steps == len(PLAN)  # end_step once per forward pass
    for step, (want, got) in enumerate(zip(plain.logits, padded.logits, strict=True)):
        assert got.shape == want.shape, f"step {step}"
        assert_close(got, want, torch.float32)
    for want, got in zip(plain_runner.kv_caches, runner.kv_caches, strict=True):
        assert_close(got, want, torch.float32)  # unused blocks stay zero: padding wrote nothing


def test_xla_backend_asks_for_buckets_and_cuts_each_step() -> None:
    adapter = xla.make_backend().adapter()
    assert isinstance(adapter.shape_buckets, ShapeBuckets)
    assert type(adapter).end_step is not DeviceAdapter.end_step
