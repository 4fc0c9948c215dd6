"""The Mamba-2 family's recurrent states through the paged forward and the engine (Mamba-2, Bamba, Granite 4.0-H,
Nemotron-H), each against transformers on its tiny preset: a varlen prefill, decodes and chunks in NaN-filled slots,
prompts prefilled 8 tokens a step, fresh sequences in reused slots, and forced preemption (hybrid_checks.py,
state_slots.py)."""

from __future__ import annotations

import pytest

from flashllm.testing.hybrid_checks import check_paged_states, reference_pair
from flashllm.testing.state_slots import (
    check_fresh_sequences_in_reused_slots,
    check_preemption_recomputes_states,
    check_states_across_prefill_chunks,
)

PRESETS = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h")
VOCAB = 256  # the presets' vocabulary


@pytest.fixture(scope="module", params=PRESETS)
def tiny(request, tmp_path_factory):
    return reference_pair(tmp_path_factory.mktemp(request.param), request.param, seed=4)


@pytest.mark.parametrize("preset", PRESETS)
def test_paged_prefill_decode_and_chunks_match_transformers(preset, loaded_pair, paged_driver) -> None:
    check_paged_states(*loaded_pair(preset), paged_driver, VOCAB)


def test_prompts_prefilled_eight_tokens_a_step_carry_their_states_across_chunks(tiny) -> None:
    check_states_across_prefill_chunks(*tiny, VOCAB)


def test_fresh_sequences_in_reused_slots_start_from_zero_states(tiny) -> None:
    check_fresh_sequences_in_reused_slots(*tiny, VOCAB)


def test_forced_preemption_recomputes_the_states_from_scratch(tiny) -> None:
    check_preemption_recomputes_states(*tiny, VOCAB)
