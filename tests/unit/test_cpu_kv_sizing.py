"""The CPU KV cache sized from available memory: MemAvailable read from /proc/meminfo (page cache counted as the
kernel counts it), its fallback, and the message when even one max_model_len sequence does not fit."""

from __future__ import annotations

import pytest

from flashllm.backends import cpu
from flashllm.backends.cpu import CpuAdapter, meminfo_available
from flashllm.core.builder import CPU_KV_MEMORY_FRACTION, EngineConfigError
from flashllm.llm import LLM
from flashllm.testing.deepseek import build_deepseek_model

MEMINFO = """MemTotal:       24000000 kB
MemFree:          300000 kB
MemAvailable:   21000000 kB
Buffers:            1000 kB
Cached:         12000000 kB
"""


def test_mem_available_is_read_from_meminfo() -> None:
    assert meminfo_available(MEMINFO) == 21000000 * 1024
    assert meminfo_available(MEMINFO.replace("MemAvailable", "MemAvail")) is None  # old kernels: no such line
    assert meminfo_available(MEMINFO.replace("21000000 kB", "lots")) is None
    assert meminfo_available("") is None


def test_the_adapter_reports_mem_available_and_falls_back_to_free_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(cpu, "meminfo_available", lambda text=None: 5 << 30)
    free, total = CpuAdapter().memory_info(None)
    assert (free, total) == (5 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    monkeypatch.setattr(cpu, "meminfo_available", lambda text=None: None)
    free, _ = CpuAdapter().memory_info(None)
    assert 0 < free <= total


def test_a_latent_cache_too_small_for_one_sequence_says_what_it_was_sized_from(tmp_path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V2-Lite's tiny shape: 2 layers x (32 + 8) fp32 latents a token, 16-token blocks = 5120 bytes a
    block; 200 KiB available leaves 10 blocks (160 tokens) for a 512-token max_model_len."""
    model_dir = build_deepseek_model(tmp_path, "v2_lite", seed=1)
    per_block = 2 * (32 + 8) * 4 * 16
    available = 200 << 10
    monkeypatch.setattr(CpuAdapter, "memory_info", lambda self, device: (available, 1 << 34))
    with pytest.raises(EngineConfigError) as caught:
        LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, max_model_len=512)
    blocks = int(available * CPU_KV_MEMORY_FRACTION) // per_block
    message = str(caught.value)
    assert f"holds {blocks} blocks ({blocks * 16} tokens, sized as 25% of the 0.00 GiB" in message
    assert f"at {per_block} bytes a block" in message and "needs 32 blocks" in message
    assert "--kv-cache-memory or lower --max-model-len" in message
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, max_model_len=blocks * 16)
    assert llm.engine.scheduler.block_manager.num_total_blocks == blocks
