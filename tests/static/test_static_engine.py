"""StaticEngine's step interface: one batch at a time, rows leaving (finished or aborted), cache trimming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("onnx_ready")

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(exported):
    from flashllm.static.runner import StaticLLM

    return StaticLLM(exported["qwen2"], device="cpu", max_num_seqs=4, max_model_len=128)


def _alone(llm, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the prompt run in a batch of its own."""
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0].outputs[0].token_ids


def _drain(engine) -> dict[str, list[int]]:
    final = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output.outputs[0].token_ids
    return final


def test_requests_arriving_mid_batch_wait_for_the_whole_batch(llm) -> None:
    engine = llm.engine
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))
    engine.step()  # prefill: `first` runs alone
    late = engine.add_request([8, 9], SamplingParams(max_tokens=2, **GREEDY))
    for _ in range(5):  # the decode steps that finish `first` (6 tokens, one from the prefill)
        assert (engine.num_running, engine.num_waiting) == (1, 1)
        engine.step()
    assert (engine.num_running, engine.num_waiting) == (0, 1)
    engine.step()  # only now `late` gets its prefill
    assert (engine.num_running, engine.num_waiting) == (1, 0)
    final = _drain(engine)
    assert final[late] == _alone(llm, [8, 9], 2)
    assert first not in engine.requests and not engine.has_unfinished()


def test_aborted_rows_leave_and_the_others_continue_unchanged(llm) -> None:
    engine = llm.engine
    prompts = [list(range(3, 40)), [11, 12, 13], [20, 21, 22, 23, 24]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=10, **GREEDY)) for p in prompts]
    for _ in range(3):
        engine.step()
    engine.abort(ids[0])  # the longest row: the cache is cut down to what the others use
    assert engine.num_running == 2
    assert engine.batch_width == max(len(p) for p in prompts[1:]) + 3 - 1
    final = _drain(engine)
    assert ids[0] not in final and set(final) == set(ids[1:])
    for request_id, prompt in zip(ids[1:], prompts[1:], strict=True):
        assert final[request_id] == _alone(llm, prompt, 10)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.integers(1, 500), min_size=1, max_size=30), st.integers(1, 12)),
                min_size=1, max_size=6))
def test_batched_greedy_tokens_equal_each_prompt_alone(llm, cases) -> None:
    """Left padding, rows finishing at different steps and cache trimming never change a row's tokens."""
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in cases]
    final = _drain(engine)
    assert [final[i] for i in ids] == [_alone(llm, p, n) for p, n in cases]
    assert engine.batch_width == 0 and not engine.requests


def test_bad_requests_are_refused_before_queueing(llm) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="beam search"):
        engine.add_request([1, 2], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        engine.add_request([1, 512], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len is 128"):
        engine.add_request(list(range(1, 129)), SamplingParams(max_tokens=4))
    assert not engine.has_unfinished() and not engine.requests
