"""EXAONE 4.0 (OLMo 2's post-norm block, per-head q / k norms, global NoPE layers beside sliding ones): config.json
read as transformers' Exaone4Config reads it, the string form of sliding_window_pattern, and two tensor-parallel ranks
giving one rank's tokens (its norms are per head). Paged-forward and engine parity with transformers run in
test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm import LLM, SamplingParams
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.tiny_models import build_tiny_model

RAW = {"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "sliding_window": 16}


@pytest.mark.parametrize("changes", [{"sliding_window_pattern": 4}, {"sliding_window_pattern": 2},
                                     {"sliding_window": None, "layer_types": ["full_attention"] * 8}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    """Sliding layers from the pattern; with a window only they rotate (global NoPE), without one all do."""
    from transformers import Exaone4Config

    ours, theirs = parse_hf_config({**RAW, **changes}), Exaone4Config(**{**RAW, **changes})
    window = theirs.sliding_window
    assert ours.sliding_windows == tuple(window if t == "sliding_attention" else None for t in theirs.layer_types)
    assert ours.rope_layers == tuple(window is None or t == "sliding_attention" for t in theirs.layer_types)
    assert ours.qk_norm


def test_the_string_pattern_names_local_and_global_layers() -> None:
    assert parse_hf_config({**RAW, "sliding_window_pattern": "LLLG"}).sliding_windows == (
        parse_hf_config({**RAW, "sliding_window_pattern": 4}).sliding_windows)
    assert parse_hf_config({**RAW, "sliding_window_pattern": "LG"}).rope_layers == (True, False) * 4
    with pytest.raises(ModelLoadError, match="sliding_window_pattern='LXG'"):
        parse_hf_config({**RAW, "sliding_window_pattern": "LXG"})


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / "exaone4", "exaone4", seed=2, tokenizer=False)
    prompts = [[5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202], [7, 3, 250]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = []
    for tp in (1, 2):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp, block_size=16,
                  num_kv_blocks=32, max_model_len=128)
        try:
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
        finally:
            llm.engine.shutdown()
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(*runs, strict=True):
        assert tokens1 == tokens2
        torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), rtol=0, atol=1e-4)
