"""LoRA under tensor parallelism (two CPU ranks over gloo): an adapter merged at load (`--lora_path`) before
each rank cuts its shard gives transformers + peft's tokens and logits; multi-LoRA is refused before any
rank starts."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.core.builder import EngineConfigError  # noqa: E402
from flashllm.testing.parity import assert_rows_match, record_logits  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter, greedy_reference, load_peft_model  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

STEPS = 32


def test_merged_adapter_on_two_ranks_matches_peft(tmp_path) -> None:
    """Every projection adapted (column-parallel q/k/v/gate/up cut by rows, row-parallel o/down by
    columns after the merge), qwen2 for the qkv bias; one prompt crossing prefill chunks, one short."""
    base = build_tiny_model(tmp_path / "base", "qwen2", seed=3, tokenizer=False)
    adapter = build_peft_adapter(base, tmp_path / "adapter", r=8, alpha=16, seed=4)
    llm = LLM(str(base), lora_path=str(adapter), device="cpu", dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="mp", block_size=16, max_num_batched_tokens=16, num_kv_blocks=32)
    try:
        rows = record_logits(llm)
        prompts = [[(7 * i + 3) % 250 + 1 for i in range(37)], [5, 9, 200]]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.engine.shutdown()
    reference = load_peft_model(base, adapter)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = greedy_reference(reference, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=1e-4)


def test_multi_lora_with_two_ranks_is_refused_before_any_rank_starts(tmp_path) -> None:
    base = build_tiny_model(tmp_path / "base", "llama", seed=3, tokenizer=False)
    with pytest.raises(EngineConfigError, match="multi-LoRA.*one rank.*--lora_path") as info:
        LLM(str(base), enable_lora=True, device="cpu", dtype="float32", tensor_parallel_size=2,
            distributed_executor_backend="mp", num_kv_blocks=8)
    assert "\n" not in str(info.value)
