"""Tensor parallelism on the CPU (gloo): two ranks give the tokens and logprobs one rank gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flashllm import LLM, SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

STEPS = 32
# two prompts sharing a 40-token prefix (the second round hits the prefix cache) and a third one
PREFIX = [(7 * i + 3) % 250 + 1 for i in range(40)]
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [21, 22], [(5 * i + 1) % 250 + 1 for i in range(70)]]
CASES = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-head-norms": ("qwen3", {}),  # each rank norms the heads it holds with the replicated q / k norms
    # fused qkv_proj / gate_up_proj cut per rank; LongRoPE's per-sequence prompt lengths reach every rank
    "phi3-longrope": ("phi3-longrope", {}),
    # the multiplied embedding (rows all-reduced across the ranks' vocabulary shards, then multiplied), the
    # multiplied branch outputs after the row-parallel reductions, logits divided after the gather
    "granite": ("granite", {}),
    # one kv head for two ranks: each rank keeps a replica of it
    "gqa-replicated": ("llama", {"num_key_value_heads": 1}),
    # row-parallel slices of whole 64-feature blocks: the cpu int4 kernel quantizes activations per
    # block of 64 input features (backends/cpu/native.py), so each rank's blocks are one rank's blocks
    "llama-wide": ("llama", {"hidden_size": 256, "intermediate_size": 256}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build_tiny_model(tmp_path_factory.mktemp(name), preset, seed=3, tokenizer=False, **overrides)
            for name, (preset, overrides) in CASES.items()}


def run(model_dir: Path, tp: int, **options) -> list:
    """Greedy tokens and their logprobs over two rounds (the second hits the prefix cache), with
    chunked prefill (16-token chunks) and 16-token blocks; then every step's full logits rows (the
    driver's, gathered over the ranks' vocabulary shards)."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None, block_size=16, max_num_batched_tokens=16,
              num_kv_blocks=64, **options)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    runner, execute_model = llm.engine.runner, llm.engine.runner.execute_model
    logits: list = []

    def recording(batch, greedy=False):
        rows = execute_model(batch, greedy)
        if not greedy:
            logits.extend(rows.clone())
        return rows

    runner.execute_model = recording
    try:
        results = []
        for _ in range(2):
            outputs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
            results += [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outputs]
        hits = [o.metrics.num_cached_tokens for o in outputs]
        assert hits[0] >= 32 and hits[1] >= 32, f"the second round should reuse the shared prefix: {hits}"
        assert llm.engine.num_free_blocks() == llm.engine.block_manager.num_total_blocks
    finally:
        llm.engine.shutdown()
    return [results, logits]


def assert_same(one: list, two: list) -> None:
    (results1, logits1), (results2, logits2) = one, two
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(results1, results2, strict=True):
        assert tokens2 == tokens1
        assert len(tokens1) == STEPS
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4
    assert len(logits1) == len(logits2) >= 2 * len(PROMPTS) * STEPS
    for row1, row2 in zip(logits1, logits2, strict=True):
        assert (row1 - row2).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_match_one(model_dirs: dict[str, Path], case: str) -> None:
    assert_same(run(model_dirs[case], 1), run(model_dirs[case], 2))


@pytest.mark.parametrize("quant_type", ["weight_only_int8", "weight_only_int4"])
def test_two_ranks_match_one_with_weight_only_quantization(model_dirs: dict[str, Path], quant_type: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           exact_w8_products: None) -> None:
    # The cpu int4 kernels' default int8-activation path picks its kernel by the weight's shape, so a
    # rank's slice may run another kernel than the whole weight (equal within the int8 rounding, not to
    # 1e-4); with fp32 activations every kernel computes the same sums. The ranks inherit the setting.
    # Per-channel w8a16's bf16-rounded activations likewise turn the all-reduce's fp32 order into
    # rounding-sized steps: exact_w8_products keeps them fp32.
    monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
    options = {"quant_type": quant_type}
    assert_same(run(model_dirs["llama-wide"], 1, **options), run(model_dirs["llama-wide"], 2, **options))


def test_plain_greedy_steps_match_too(model_dirs: dict[str, Path]) -> None:
    """Without logprobs the driver takes its greedy path (argmax only); the tokens do not change."""
    def tokens(tp: int) -> list[list[int]]:
        llm = LLM(str(model_dirs["llama"]), device="cpu", tensor_parallel_size=tp, num_kv_blocks=64, block_size=16)
        try:
            outputs = llm.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16,
                                                                               ignore_eos=True), use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [list(o.outputs[0].token_ids) for o in outputs]

    assert tokens(2) == tokens(1)


def test_prompt_logprobs_match_one_rank(model_dirs: dict[str, Path]) -> None:
    """Prompt logprobs need the whole vocabulary's logits of every prompt row: the other rank joins the LM
    head's gathers for the rows the driver records, chunk by chunk (16-token steps)."""
    def prompt_logprobs(tp: int) -> list:
        llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", tensor_parallel_size=tp,
                  num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
        try:
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=1)
            outputs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [(o.prompt_logprobs, list(o.outputs[0].token_ids)) for o in outputs]

    one, two = prompt_logprobs(1), prompt_logprobs(2)
    assert [len(lp) for lp, _ in one] == [len(p) for p in PROMPTS] and one[0][0][5] is not None
    for (lp1, tokens1), (lp2, tokens2) in zip(one, two, strict=True):
        assert tokens2 == tokens1 and lp2[0] is None
        for a, b in zip(lp1[1:], lp2[1:], strict=True):
            assert b[0] == pytest.approx(a[0], abs=1e-4) and [t for t, _ in b[1]] == [t for t, _ in a[1]]


def test_embeddings_match_one_rank(model_dirs: dict[str, Path]) -> None:
    """The driver pools its own hidden states (whole on every rank after the row-parallel reductions): mean
    pooling over 16-token chunks and last-token pooling give one rank's vectors."""
    from flashllm.sampling_params import Pooling

    def vectors(tp: int) -> list[list[float]]:
        llm = LLM(str(model_dirs["qwen3-head-norms"]), device="cpu", dtype="float32", tensor_parallel_size=tp,
                  num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
        try:
            return [o.outputs.embedding for kind in ("mean", "last")
                    for o in llm.embed([list(p) for p in PROMPTS], Pooling(kind))]
        finally:
            llm.engine.shutdown()

    one, two = torch.tensor(vectors(1)), torch.tensor(vectors(2))
    assert one.shape == (6, 64)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-4)


def test_more_ranks_than_heads_is_refused(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(Exception, match="num_attention_heads"):
        LLM(str(model_dirs["llama"]), device="cpu", tensor_parallel_size=8, num_kv_blocks=64, block_size=16)


def test_worker_processes_are_gone_after_shutdown(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), device="cpu", tensor_parallel_size=2, num_kv_blocks=64, block_size=16)
    pids = [proc.pid for proc in llm.engine.executor._launcher.procs]
    llm.engine.shutdown()
    for pid in pids:
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): count it as gone only once reaped
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"
