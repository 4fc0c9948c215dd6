"""What the engine does around a model with per-sequence recurrent state (tiny LFM2: short convolutions beside
attention): one state slot per seat, prefix caching off (a repeated prompt would otherwise skip its convolution
states), speculative decoding refused at build, and a chunked scoring window equal to one pass."""

from __future__ import annotations

import pytest
import torch

from flashllm.core.runner_select import EngineConfigError
from flashllm.eval.forward import ScoringConfig, load_scoring_parts, window_hidden
from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.parity import random_tokens
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("lfm2"), "lfm2")


def test_states_take_a_slot_per_seat_and_a_repeated_prompt_recomputes(lfm2_dir) -> None:
    llm = LLM(str(lfm2_dir), dtype="float32", device="cpu", block_size=16, max_model_len=128, max_num_seqs=3)
    engine = llm.engine
    assert engine.parts.num_state_slots == 3
    assert not engine.block_manager.enable_prefix_caching  # a cached block holds no convolution state
    prompt = random_tokens(40, engine.parts.hf_config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    again = llm.generate([prompt, prompt], params)
    assert [o.outputs[0].token_ids for o in again] == [first, first]
    assert engine.block_manager.num_cached_blocks == 0


def test_speculative_decoding_is_refused_before_the_cache_is_built(lfm2_dir) -> None:
    with pytest.raises(EngineConfigError, match="recurrent state per sequence.*speculat"):
        LLM(str(lfm2_dir), dtype="float32", device="cpu", max_model_len=128,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_scoring_window_in_chunks_carries_its_state(lfm2_dir) -> None:
    parts = load_scoring_parts(ScoringConfig(str(lfm2_dir), dtype="float32", device="cpu"), 64)
    tokens = random_tokens(50, parts.hf_config.vocab_size, seed=5)
    whole = window_hidden(parts, tokens)
    chunked = window_hidden(parts, tokens, chunk_tokens=7)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
