"""The export decoder's attention mask against a naive loop, and what it refuses to load (no onnx needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.models.hf_config import ModelLoadError
from flashllm.static.decoder import attention_allowed, load_static_decoder


@st.composite
def padded_batches(draw):
    """Rows of (left padding, past tokens, new tokens) sharing one past width and one new width."""
    batch = draw(st.integers(1, 4))
    new = draw(st.integers(1, 5))
    width = draw(st.integers(0, 8))
    pads = [draw(st.integers(0, width)) for _ in range(batch)]
    window = draw(st.none() | st.integers(1, 6))
    return pads, width, new, window


@settings(max_examples=60, deadline=None)
@given(padded_batches())
def test_mask_allows_exactly_the_causal_window_of_real_tokens(case) -> None:
    pads, width, new, window = case
    mask = torch.tensor([[0] * pad + [1] * (width + new - pad) for pad in pads])
    positions = torch.tensor([[width - pad + t for t in range(new)] for pad in pads])
    allowed = attention_allowed(positions, mask, window)
    assert allowed.shape == (len(pads), 1, new, width + new)
    for b, pad in enumerate(pads):
        for t in range(new):
            q = width - pad + t  # the query's position among its row's real tokens
            for j in range(width + new):
                k = j - pad  # the key's position; negative = padding
                expected = 0 <= k <= q and (window is None or q - k < window)
                assert bool(allowed[b, 0, t, j]) == expected, (b, t, j)


def _write_config(directory: Path, **fields) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 16, **fields}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_refuses_other_architectures_and_quantized_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="MistralForCausalLM"):
        load_static_decoder(_write_config(tmp_path / "a", architectures=["MistralForCausalLM"]))
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": -1}
    with pytest.raises(ModelLoadError, match="float weights"):
        load_static_decoder(_write_config(tmp_path / "b", quantization_config=gptq))


def test_refuses_mis_shaped_and_missing_tensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    directory = _write_config(tmp_path / "c")
    save_file({"model.embed_tokens.weight": torch.zeros(16, 4)}, directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.embed_tokens.weight.*\(16, 4\)"):
        load_static_decoder(directory)
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing"):
        load_static_decoder(directory)


def test_device_picks_onnxruntime_providers() -> None:
    from flashllm.static.manifest import StaticModelError
    from flashllm.static.runner import select_providers

    cpu_only, with_cuda = ["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert select_providers("auto", cpu_only) == ["CPUExecutionProvider"]
    assert select_providers("auto", with_cuda) == with_cuda
    assert select_providers("cpu", with_cuda) == ["CPUExecutionProvider"]
    assert select_providers("cuda:1", with_cuda) == [("CUDAExecutionProvider", {"device_id": 1}),
                                                     "CPUExecutionProvider"]
    with pytest.raises(StaticModelError, match="onnxruntime-gpu"):
        select_providers("cuda", cpu_only)
    with pytest.raises(StaticModelError, match="not supported in static mode"):
        select_providers("npu:0", with_cuda)
