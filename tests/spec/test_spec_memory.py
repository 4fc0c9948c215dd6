"""A drafter's own cache (draft model, MTP layer, EAGLE head) is inside the KV memory budget: the block count is
what the configs say fits both caches, each cache has that many blocks, and together they stay within the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import build_deepseek_mtp_model
from flashllm.testing.eagle import build_eagle3_head, build_eagle_head
from flashllm.testing.tiny_models import build_tiny_model

BLOCK = 16
FP32 = 4


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _kv_bytes_per_block(model_dir: Path, layers: int | None = None) -> int:
    """K and V of every layer for BLOCK tokens in fp32, from config.json alone."""
    c = _config(model_dir)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * (layers or c["num_hidden_layers"]) * BLOCK * c["num_key_value_heads"] * head_dim * FP32


def _latent_bytes_per_block(model_dir: Path, layers: int) -> int:
    """DeepSeek's one latent cache a layer: kv_lora_rank + qk_rope_head_dim per token, fp32."""
    c = _config(model_dir)
    return layers * BLOCK * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * FP32


def _llm(model_dir: Path, speculative, **kwargs) -> LLM:
    return LLM(str(model_dir), backend="cpu", dtype="float32", block_size=BLOCK, max_model_len=128,
               speculative_config=speculative, **kwargs)


def _check(llm: LLM, budget: int, target_per_block: int, draft_per_block: int) -> None:
    engine = llm.engine
    blocks = engine.block_manager.num_total_blocks
    assert blocks == budget // (target_per_block + draft_per_block)
    target = engine.parts.runner.kv_cache_bytes()
    draft = engine.speculator.proposer.kv_cache_bytes()
    assert target == blocks * target_per_block
    assert draft == blocks * draft_per_block
    assert target + draft <= budget
    # and the engine still decodes with drafts in that cache
    out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_draft_models_cache_is_inside_kv_cache_memory(tmp_path: Path) -> None:
    target = build_tiny_model(tmp_path / "target", "llama", seed=3, tokenizer=False, num_hidden_layers=3)
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=4, tokenizer=False, num_hidden_layers=1,
                             num_key_value_heads=1)
    target_per_block, draft_per_block = _kv_bytes_per_block(target), _kv_bytes_per_block(draft)
    assert draft_per_block != target_per_block  # a test that mixed the two up would fail
    budget = 37 * (target_per_block + draft_per_block) + target_per_block  # not a multiple of either
    plain = _llm(target, None, kv_cache_memory=budget)
    assert plain.engine.block_manager.num_total_blocks == budget // target_per_block
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    _check(_llm(target, spec, kv_cache_memory=budget), budget, target_per_block, draft_per_block)
    # --num-kv-blocks sizes both caches alike
    llm = _llm(target, spec, num_kv_blocks=20)
    assert llm.engine.speculator.proposer.kv_cache_bytes() == 20 * draft_per_block
    # a budget that fits one sequence for the target alone, but not with the draft's cache, is refused
    with pytest.raises(ValueError, match="drafter") as info:
        _llm(target, spec, kv_cache_memory=(128 // BLOCK) * target_per_block)
    assert "\n" not in str(info.value)


def test_an_mtp_layers_cache_is_inside_kv_cache_memory(tmp_path: Path) -> None:
    target = build_deepseek_mtp_model(tmp_path / "mtp", "v3", seed=5)
    layers = _config(target)["num_hidden_layers"]
    target_per_block, mtp_per_block = _latent_bytes_per_block(target, layers), _latent_bytes_per_block(target, 1)
    budget = 29 * (target_per_block + mtp_per_block) + mtp_per_block
    _check(_llm(target, {"method": "mtp", "num_speculative_tokens": 2}, kv_cache_memory=budget), budget,
           target_per_block, mtp_per_block)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_heads_cache_is_inside_kv_cache_memory(tmp_path: Path, method: str) -> None:
    target = build_tiny_model(tmp_path / "target", "llama", seed=3, tokenizer=False, num_hidden_layers=7)
    build = build_eagle_head if method == "eagle" else build_eagle3_head
    head = build(tmp_path / "head", target, seed=6)
    target_per_block, head_per_block = _kv_bytes_per_block(target), _kv_bytes_per_block(head)
    budget = 33 * (target_per_block + head_per_block) + head_per_block
    _check(_llm(target, {"method": method, "model": str(head), "num_speculative_tokens": 3},
                kv_cache_memory=budget), budget, target_per_block, head_per_block)


def test_the_share_of_free_memory_covers_both_caches(tmp_path: Path, monkeypatch) -> None:
    """Without an explicit size the CPU cache takes CPU_KV_MEMORY_FRACTION of the free memory: both caches."""
    from flashllm.backends.cpu import CpuAdapter
    from flashllm.core.builder import CPU_KV_MEMORY_FRACTION

    target = build_tiny_model(tmp_path / "target", "llama", seed=3, tokenizer=False, num_hidden_layers=3)
    draft = build_tiny_model(tmp_path / "draft", "llama", seed=4, tokenizer=False, num_hidden_layers=1)
    per_block = _kv_bytes_per_block(target) + _kv_bytes_per_block(draft)
    free = int(51 * per_block / CPU_KV_MEMORY_FRACTION)  # 51 blocks of both (fewer than max_num_seqs want)
    monkeypatch.setattr(CpuAdapter, "memory_info", lambda self, device: (free, 2 * free))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    _check(_llm(target, spec), int(free * CPU_KV_MEMORY_FRACTION), _kv_bytes_per_block(target),
           _kv_bytes_per_block(draft))
