"""The cpu backend's place_weights: large weights copied into huge-page-advised memory, ties kept."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from flashllm.backends.cpu import huge_pages
from flashllm.ops.quant_matmul import QuantizedWeight
from flashllm.quant.weight_only import quantize_weight

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")

BIG = (1024, 1024)  # 4 MiB of fp32: two huge pages


class Holder(nn.Module):
    def __init__(self, weight: nn.Parameter, quantized: QuantizedWeight | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.small = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("table", torch.randn(*BIG))
        self.quantized = quantized


def _model() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    shared = nn.Parameter(torch.randn(*BIG, generator=gen))
    model = nn.Module()
    model.embed = Holder(shared)
    model.head = Holder(shared, quantize_weight(torch.randn(4096, 1024, generator=gen), "w8a16"))
    return model


def test_large_weights_move_to_2mib_aligned_copies_and_ties_stay_tied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "1")
    model = _model()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    codes, scales = model.head.quantized.data.clone(), model.head.quantized.scales.clone()
    model.head.quantized.kernel_cache["stale"] = object()
    old_small = model.embed.small.data_ptr()

    placed, moved = huge_pages.place_weights(model)

    # the shared weight once, two buffers, the int8 codes (4 MiB); the small tensors stay where they were
    assert placed == moved == 3 * 4 * 2**20 + 4 * 2**20
    assert model.embed.weight is model.head.weight
    assert model.embed.weight.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert model.embed.table.data_ptr() % huge_pages.HUGE_PAGE == 0 and model.head.table.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert model.embed.small.data_ptr() == old_small
    q = model.head.quantized
    assert q.data.data_ptr() % huge_pages.HUGE_PAGE == 0 and torch.equal(q.data, codes) and torch.equal(q.scales, scales)
    assert q.kernel_cache == {}  # re-layouts of the old storage are dropped
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name


def test_two_parameters_on_one_storage_stay_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "1")
    storage = torch.randn(*BIG)
    model = nn.Module()
    model.a, model.b = Holder(nn.Parameter(storage)), Holder(nn.Parameter(storage))
    view = nn.Parameter(storage[512:])  # a view into the middle of a storage never moves
    model.c = Holder(view)
    huge_pages.place_weights(model)
    assert model.a.weight.data_ptr() == model.b.weight.data_ptr() != storage.data_ptr()
    assert model.c.weight.data_ptr() == storage[512:].data_ptr()


def test_switched_off_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    model = _model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.place_weights(model) == (0, 0)
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_a_copy_is_independent_of_its_source() -> None:
    source = torch.randn(*BIG)
    copy = huge_pages.huge_page_copy(source)
    assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    source.zero_()
    assert copy.abs().sum() > 0
    small = torch.randn(16)
    assert huge_pages.huge_page_copy(small) is small


def test_the_engine_places_a_loaded_model_and_still_matches_transformers(tmp_path, monkeypatch) -> None:
    # a tied 8192 x 96 vocabulary (3 MiB of fp32): the one tensor that moves; logits as transformers computes them
    from transformers import AutoModelForCausalLM

    from flashllm.llm import LLM
    from flashllm.sampling_params import SamplingParams
    from flashllm.testing.tiny_models import build_tiny_model

    monkeypatch.setenv(huge_pages.ENV_SWITCH, "1")
    model_dir = build_tiny_model(tmp_path / "m", "llama-tied", tokenizer=False, vocab_size=8192, hidden_size=96)
    llm = LLM(str(model_dir), device="cpu", max_model_len=128)
    embed = [p for p in llm.engine.runner.model.parameters() if p.numel() == 8192 * 96]
    assert embed and all(p.data_ptr() % huge_pages.HUGE_PAGE == 0 for p in embed)
    prompt = [5, 17, 300, 4000, 8000]
    got = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(prompt):]
    assert got == want.tolist()


def test_weights_loaded_into_place_count_as_placed_not_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """After place_empty (loading writes into huge pages), place_weights reports those bytes as placed and only
    what it copies itself (the buffers, the int8 codes) as moved: the start-up log says both."""
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "1")
    model = _model()
    empty = huge_pages.place_empty(model)
    assert empty == 4 * 2**20  # the shared weight, once (the small ones stay)
    placed, moved = huge_pages.place_weights(model)
    assert moved == 2 * 4 * 2**20 + 4 * 2**20
    assert placed == empty + moved
