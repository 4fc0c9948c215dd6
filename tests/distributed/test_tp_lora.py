"""LoRA under tensor parallelism (two CPU ranks over gloo): an adapter merged at load (`--lora_path`) before
each rank cuts its shard, and multi-LoRA with each rank holding its part of every adapter, give
transformers + peft's tokens and logits."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.lora import LoRARequest  # noqa: E402
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


def test_multi_lora_on_two_ranks_matches_peft_and_one_rank(tmp_path) -> None:
    """Three adapters (ranks 8 and 4, rsLoRA, different targets) and base rows in one batch over two
    slots, so the driver swaps adapters through the slots and the other rank repeats its loads; qwen2
    with 2 KV heads; chunked prefill. Every logits row within 1e-4 of transformers + peft, greedy
    tokens identical over 32 steps, and the same tokens as one rank."""
    base = build_tiny_model(tmp_path / "base", "qwen2", seed=3, tokenizer=False)
    specs = [(8, 16, None, False), (4, 12, ("q_proj", "v_proj", "o_proj", "down_proj"), True),
             (8, 8, ("k_proj", "gate_proj", "up_proj"), False)]
    loras = []
    for i, (r, alpha, targets, rslora) in enumerate(specs):
        extra = {} if targets is None else {"targets": targets}
        path = build_peft_adapter(base, tmp_path / f"a{i}", r=r, alpha=alpha, use_rslora=rslora, seed=10 + i,
                                  **extra)
        loras.append(LoRARequest(f"a{i}", i + 1, str(path)))
    prompts = [[(7 * i + 3) % 250 + 1 for i in range(37)], [5, 9, 200], [11] * 20, [3, 1, 4, 1, 5], [8, 8]]
    chosen = [loras[0], None, loras[1], loras[2], loras[0]]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu", dtype="float32", block_size=16,
                   max_num_batched_tokens=16, num_kv_blocks=48, max_num_seqs=3)
    llm = LLM(str(base), tensor_parallel_size=2, distributed_executor_backend="mp", **options)
    try:
        rows = record_logits(llm)
        outputs = llm.generate(prompts, params, lora_request=chosen, use_tqdm=False)
        assert llm.engine.runner.lora.num_slot_loads > 2, "the test meant to swap adapters through the slots"
    finally:
        llm.engine.shutdown()
    one_rank = LLM(str(base), **options).generate(prompts, params, lora_request=chosen, use_tqdm=False)
    models = {lora.lora_path: load_peft_model(base, lora.lora_path) for lora in loras}
    for prompt, lora, output, alone in zip(prompts, chosen, outputs, one_rank, strict=True):
        reference = models[(lora or loras[0]).lora_path]
        if lora is None:
            with reference.disable_adapter():
                tokens, logits = greedy_reference(reference, prompt, STEPS)
        else:
            tokens, logits = greedy_reference(reference, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens == alone.outputs[0].token_ids
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=1e-4)
