"""models/layers/embedding.gather_whole_vocabulary builds the driver's whole copies of a model's embedding and LM
head as the model has them: the asked-for tables only, the head tied where the model's is, per-channel int8 where
the model's is (--quantize_lm_head), a GGUF head's type kept. Tables of one rank need no collective (they are
shared, not copied), so the modules are checked here against the model's own; tests/distributed/test_tp_spec.py
gathers over two ranks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from flashllm.models.layers.embedding import LMHead, VocabEmbedding, gather_whole_vocabulary, target_vocabulary
from flashllm.ops.quant_matmul import quant_matmul

OPS = SimpleNamespace(quant_matmul=quant_matmul)
V, H = 40, 32


def _model(tied: bool, quantized: bool, gguf_type: str | None = None) -> tuple[VocabEmbedding, LMHead]:
    generator = torch.Generator().manual_seed(3)
    embed = VocabEmbedding(V, H, torch.float32, torch.device("cpu"))
    embed.weight.data.copy_(torch.randn(V, H, generator=generator))
    head = LMHead(V, H, OPS, torch.float32, torch.device("cpu"))
    if tied:
        head.tie_to(embed)
    else:
        head.weight.data.copy_(torch.randn(V, H, generator=generator))
    head.process_weights_after_loading(SimpleNamespace(lm_head=quantized))
    if gguf_type is not None:
        head.qweight = dataclasses.replace(head.qweight, gguf_type=gguf_type)
    return embed, head


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("quantized", [False, True])
def test_the_copies_compute_what_the_models_modules_compute(tied: bool, quantized: bool) -> None:
    embed, head = _model(tied, quantized and not tied)  # a tied head keeps its float table
    whole_embed, whole_head = gather_whole_vocabulary(embed, head, OPS)
    ids, hidden = torch.tensor([0, 7, V - 1]), torch.randn(3, H)
    assert torch.equal(whole_embed(ids), embed(ids))
    assert torch.equal(whole_head(hidden), head(hidden))
    assert whole_head.qweight.scheme == head.qweight.scheme
    assert (whole_head.weight is whole_embed.weight) == tied
    # new modules; a table already whole on this rank (one rank here) is shared with them, not copied
    assert whole_embed is not embed and whole_head is not head
    assert whole_embed.weight.data_ptr() == embed.weight.data_ptr()


def test_only_the_asked_for_tables_are_copied() -> None:
    embed, head = _model(tied=False, quantized=False)
    whole_embed, whole_head = gather_whole_vocabulary(embed, head, OPS, (True, False))
    assert whole_head is None and isinstance(whole_embed, VocabEmbedding)
    whole_embed, whole_head = gather_whole_vocabulary(embed, head, OPS, (False, True))
    assert whole_embed is None and isinstance(whole_head, LMHead)
    # a tied head still gets its table, through an embedding only the head holds
    embed, head = _model(tied=True, quantized=False)
    whole_embed, whole_head = gather_whole_vocabulary(embed, head, OPS, (False, True))
    assert whole_embed is None and torch.equal(whole_head.weight, embed.weight)


def test_a_gguf_heads_type_is_kept() -> None:
    embed, head = _model(tied=False, quantized=False, gguf_type="Q8_0")
    assert gather_whole_vocabulary(embed, head, OPS)[1].qweight.gguf_type == "Q8_0"


def test_given_modules_take_the_place_of_the_models_own() -> None:
    embed, head = _model(tied=False, quantized=False)
    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=head)
    copies = gather_whole_vocabulary(embed, head, OPS, (True, False))
    assert target_vocabulary(model) == (embed, head)
    assert target_vocabulary(model, copies) == (copies[0], head)
