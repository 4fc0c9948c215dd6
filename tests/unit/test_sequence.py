"""Sequence state: token bookkeeping, prefill/decode classification, clone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashllm.core
from flashllm.core.sequence import FinishReason, Sequence, SequenceStatus

token_lists = st.lists(st.integers(0, 50_000), min_size=1, max_size=40)


@given(prompt=token_lists, outputs=st.lists(st.integers(0, 50_000), max_size=20))
def test_token_views_split_prompt_and_output(prompt: list[int], outputs: list[int]) -> None:
    seq = Sequence("r", prompt)
    for t in outputs:
        seq.append_token(t)
    assert seq.token_ids == prompt + outputs
    assert seq.prompt_token_ids == prompt
    assert seq.output_token_ids == outputs
    assert seq.num_prompt_tokens == len(prompt)
    assert seq.num_output_tokens == len(outputs)
    assert seq.num_tokens == len(prompt) + len(outputs)
    assert seq.last_token_id == (prompt + outputs)[-1]


def test_prompt_is_copied_not_aliased() -> None:
    prompt = [1, 2, 3]
    seq = Sequence("r", prompt)
    seq.append_token(4)
    prompt.append(99)
    assert seq.token_ids == [1, 2, 3, 4]
    seq.prompt_token_ids.append(7)  # a copy: mutating it must not touch the sequence
    assert seq.token_ids == [1, 2, 3, 4]


def test_seq_ids_are_unique_and_increasing() -> None:
    seqs = [Sequence("r", [1]) for _ in range(50)]
    ids = [s.seq_id for s in seqs]
    assert len(set(ids)) == 50
    assert ids == sorted(ids)


def test_new_sequence_defaults() -> None:
    seq = Sequence("req-7", [5, 6], sampling_params=object(), arrival_time=12.5)
    assert seq.status is SequenceStatus.WAITING
    assert seq.finish_reason is None
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    assert seq.arrival_time == 12.5
    assert not seq.is_finished


def test_empty_prompt_rejected() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("r", [])


@given(prompt_len=st.integers(1, 30), num_out=st.integers(0, 10), data=st.data())
def test_is_prefill_and_uncomputed(prompt_len: int, num_out: int, data: st.DataObject) -> None:
    seq = Sequence("r", range(prompt_len))
    for t in range(num_out):
        seq.append_token(t)
    seq.num_computed_tokens = data.draw(st.integers(0, seq.num_tokens))
    uncomputed = seq.num_tokens - seq.num_computed_tokens
    assert seq.num_uncomputed_tokens == uncomputed
    assert seq.is_prefill == (uncomputed > 1 or num_out == 0)


def test_decode_after_prefill_and_one_token_prompt() -> None:
    one = Sequence("r", [3])
    assert one.is_prefill  # its only step runs the prompt
    one.num_computed_tokens = 1
    one.append_token(8)
    assert not one.is_prefill and one.num_uncomputed_tokens == 1


def test_finish_reason_compares_as_string() -> None:
    assert FinishReason("abort") is FinishReason.ABORT
    assert FinishReason.STOP == "stop" and str(FinishReason.LENGTH) == "length"


def test_clone_copies_tokens_but_not_kv_state() -> None:
    params = object()
    seq = Sequence("r", [1, 2, 3], sampling_params=params)
    seq.append_token(4)
    seq.num_computed_tokens = 3
    seq.block_table = [7]
    seq.status = SequenceStatus.RUNNING
    child = seq.clone()
    assert child.seq_id != seq.seq_id and child.request_id == "r"
    assert child.token_ids == [1, 2, 3, 4] and child.num_prompt_tokens == 3
    assert child.sampling_params is params and child.status is SequenceStatus.RUNNING
    assert child.block_table == [] and child.num_computed_tokens == 0
    child.append_token(5)
    assert seq.token_ids == [1, 2, 3, 4]
    assert seq.clone("other").request_id == "other"


@pytest.mark.parametrize("module", ["sequence", "block_manager", "scheduler"])
def test_core_state_modules_do_not_import_torch(module: str) -> None:
    # Scheduler-side state must stay torch-free (ARCHITECTURE.md); checked statically so that a
    # torch import elsewhere in the package (flashllm/__init__.py) does not blur the answer.
    source = (Path(flashllm.core.__file__).parent / f"{module}.py").read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported and "numpy" not in imported
