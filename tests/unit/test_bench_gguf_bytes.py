"""The bench's weight bytes of a GGUF file are the file's bytes, not the 0 of a directory with no safetensors."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def test_parameter_bytes_of_a_gguf_file_is_its_size(tmp_path):
    from flashllm.bench.shapes import parameter_bytes

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert parameter_bytes(path) == path.stat().st_size > 64 * 32 * 4
    # a directory still counts its safetensors only
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    assert parameter_bytes(tmp_path) == 10
