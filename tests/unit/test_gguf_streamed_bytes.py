"""What a batch-1 decode step reads of a GGUF file (the llama.cpp baseline's ceiling, bench/gguf_moe.py),
on files written here with gguf's own writer and counted by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from flashllm.bench.gguf_moe import streamed_bytes  # noqa: E402

E, K_USED, H, INTER, VOCAB = 8, 2, 32, 16, 64


def _write(path: Path, tensors: dict[str, np.ndarray], experts: int | None) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(K_USED)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _f32(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def test_a_moe_file_counts_the_routed_experts_and_not_the_embedding_table(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": _f32(VOCAB, H), "output.weight": _f32(VOCAB, H),
               "blk.0.attn_q.weight": _f32(H, H), "blk.0.ffn_gate_exps.weight": _f32(E, INTER, H),
               "blk.0.ffn_down_exps.weight": _f32(E, H, INTER), "blk.0.ffn_gate_shexp.weight": _f32(INTER, H)}
    path = _write(tmp_path / "moe.gguf", tensors, E)
    # the head, attention and shared expert whole; K_USED of E experts; no embedding table
    expected = 4 * (VOCAB * H + H * H + INTER * H) + 4 * K_USED * (INTER * H + H * INTER)
    assert streamed_bytes(path) == expected
    assert expected < path.stat().st_size


def test_a_dense_file_with_a_tied_head_counts_the_table_it_reads_as_the_head(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": _f32(VOCAB, H), "blk.0.attn_q.weight": _f32(H, H),
               "blk.0.ffn_up.weight": _f32(INTER, H)}
    path = _write(tmp_path / "dense.gguf", tensors, None)
    assert streamed_bytes(path) == 4 * (VOCAB * H + H * H + INTER * H)
