"""Adapter rows in the cpu backend's fused decode step and multi-step greedy bursts (csrc/decode_lora.c).

The oracle is transformers + peft (unmerged): a batch mixing adapters and base rows decodes through
the fused native step (every logits row within 1e-4, greedy tokens identical) and through bursts
(tokens identical over 32 steps); a direct fused step equals the model's own layer-by-layer LoRA
forward, and a slot outside the tables is refused before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from flashllm.backends.cpu import decode_burst, decode_stack, native  # noqa: E402
from flashllm.llm import LLM  # noqa: E402
from flashllm.lora import LoRARequest  # noqa: E402
from flashllm.ops.attention_metadata import AttentionMetadata  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.greedy_rows import greedy_screen_rows  # noqa: E402
from flashllm.testing.parity import assert_rows_match, record_logits  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter, greedy_reference, load_peft_model  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

STEPS = 32
# rank 8 on every projection; rank 4 rsLoRA on a subset (zero-padded to the slots' rank 8)
ADAPTERS = [(8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
            (4, 12, ("q_proj", "v_proj", "up_proj", "down_proj"), True)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory) -> tuple[Path, list[LoRARequest]]:
    root = tmp_path_factory.mktemp(f"fused-{request.param}")
    base = build_tiny_model(root / "base", request.param, seed=5, tokenizer=False)
    loras = []
    for i, (r, alpha, targets, rslora) in enumerate(ADAPTERS):
        path = build_peft_adapter(base, root / f"a{i}", r=r, alpha=alpha, targets=targets, use_rslora=rslora,
                                  seed=40 + i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(path)))
    return base, loras


def _llm(base: Path, **kw) -> LLM:
    return LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", device="cpu",
               block_size=16, max_model_len=128, num_kv_blocks=64, **kw)


def _count(monkeypatch, cls, method: str) -> list[bool]:
    """Decode calls of cls.method that got adapter slots, True where the native call took the step."""
    taken: list[bool] = []
    real = getattr(cls, method)

    def counting(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if args[-1] is not None and args[3].max_seqlen_q == 1:  # lora_slots, and a decode step
            taken.append(out is not None)
        return out

    monkeypatch.setattr(cls, method, counting)
    return taken


def _references(base: Path, loras: list[LoRARequest], prompts, chosen, steps: int):
    models = {lora.lora_path: load_peft_model(base, lora.lora_path) for lora in loras}
    out = []
    for prompt, lora in zip(prompts, chosen, strict=True):
        if lora is None:
            with models[loras[0].lora_path].disable_adapter():
                out.append(greedy_reference(models[loras[0].lora_path], prompt, steps))
        else:
            out.append(greedy_reference(models[lora.lora_path], prompt, steps))
    return out


PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63))]
CHOSEN = [0, None, 1, 0]  # adapter index per prompt; None: the base model


def test_fused_steps_with_adapter_rows_match_peft(setup, monkeypatch) -> None:
    base, loras = setup
    taken = _count(monkeypatch, decode_stack.FusedDecode, "__call__")
    llm = _llm(base)
    rows = record_logits(llm)  # single steps: the fused step, not bursts
    chosen = [None if i is None else loras[i] for i in CHOSEN]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
                        lora_request=chosen)
    assert len(taken) >= STEPS - 1 and all(taken), "decode steps with adapter rows should run the fused step"
    for prompt, out, (tokens, logits) in zip(PROMPTS, outs, _references(base, loras, PROMPTS, chosen, STEPS),
                                             strict=True):
        assert out.outputs[0].token_ids == tokens
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=1e-4)


def test_bursts_with_adapter_rows_give_peft_tokens(setup, monkeypatch) -> None:
    base, loras = setup
    taken = _count(monkeypatch, decode_burst.GreedyBurst, "__call__")
    llm = _llm(base, num_scheduler_steps=8, max_num_seqs=greedy_screen_rows())  # batches a burst takes
    chosen = [None if i is None else loras[i] for i in CHOSEN]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
                        lora_request=chosen)
    if llm.engine.runner._burst() is None:
        pytest.skip("no greedy burst on this CPU (the greedy screen does not apply)")
    assert taken and all(taken), "bursts with adapter rows should run natively"
    for out, (tokens, _) in zip(outs, _references(base, loras, PROMPTS, chosen, STEPS), strict=True):
        assert out.outputs[0].token_ids == tokens


def _decode_metadata(slots: list[int], lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.arange(len(slots) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=max(lens))


def test_a_direct_fused_step_equals_the_layer_by_layer_lora_forward(setup) -> None:
    base, loras = setup
    llm = _llm(base)
    runner = llm.engine.runner
    manager, model, caches = runner.lora, runner.model, runner.kv_caches
    for lora in loras:
        manager.add(lora)
    # rows: adapter 0, base, adapter 1, adapter 0 (grouped per slot in C, in any order)
    manager.prepare([1, 0, 2, 1], [1, 1, 1, 1], 4)
    slots = manager.context.indices.clone()
    assert sorted(set(slots.tolist())) == [-1, 0, 1]
    fused = decode_stack.build(model)
    assert fused is not None
    ids, positions = torch.tensor([3, 4, 5, 6]), torch.tensor([5, 20, 1, 33])
    md = _decode_metadata([5, 16 + 4, 2 * 16 + 1, 3 * 16 + 1], [6, 21, 2, 34], [[0, 0, 0], [5, 1, 0], [2, 0, 0],
                                                                                 [6, 7, 3]])
    with torch.inference_mode():
        expected = model(ids, positions, [tuple(c.clone() for c in layer) for layer in caches], md)
        manager.context.indices = None
        plain = model(ids, positions, [tuple(c.clone() for c in layer) for layer in caches], md)
        got = fused(ids, positions, caches, md, slots)
        assert got is not None
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain[0], expected[0], atol=1e-3)  # the adapters change the adapted rows
        torch.testing.assert_close(got[1], plain[1], atol=1e-5, rtol=1e-5)  # the base row is the base model's
        for bad in ([0, -1, 2, 0], [0, -2, 1, 0], [0, 0, 0]):  # past the 2 slots, below -1, a slot per token
            assert fused(ids, positions, caches, md, torch.tensor(bad)) is None
        assert fused(ids, positions, caches, md, slots.int()) is None  # slots the C code cannot read
