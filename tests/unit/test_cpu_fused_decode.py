"""The cpu backend's fused decode step (decode_stack.py) against the per-op path it replaces.

The fused step runs the same native kernels in the same order, so greedy tokens and logprobs must
be identical, not merely close, with it on and off; and every step it cannot take (prefill, a
bad index, an unsupported model) must fall back to the model's own forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.backends.cpu import decode_stack, native
from flashllm.llm import LLM
from flashllm.ops.attention_metadata import AttentionMetadata
from flashllm.sampling_params import SamplingParams
from flashllm.testing.fused_decode import record_fused_steps
from flashllm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.unavailable_reason()}")

PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [8] * 20, [1, 2], list(range(30, 63)), [9]]
MAX_TOKENS = [24, 9, 30, 17, 5]  # sequences leave the decode batch at different steps


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])  # GQA; qkv bias, tied; q / k norms
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=7, tokenizer=False)


def _generate(model_dir: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **kwargs) -> tuple[list, list, int]:
    """(tokens, top-3 logprobs per step, decode steps the fused path took) of one engine run."""
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if fused else "0")
    taken = record_fused_steps(monkeypatch)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=32, max_model_len=128,
              **kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [(o.outputs[0].logprobs, o.outputs[0].top_logprobs) for o in outs]
    return tokens, logprobs, sum(taken)


@pytest.mark.parametrize("quant,w8_activations", [({}, "fp32"), ({"quant_type": "w8a16"}, "fp32"),
                                                  ({"quant_type": "w8a16"}, "int8"),
                                                  ({"quant_type": "w4a16", "group_size": 32}, "fp32")])
def test_fused_decode_computes_exactly_what_the_per_op_path_does(model_dir, monkeypatch, quant, w8_activations) -> None:
    monkeypatch.setenv(native.W8_ACTIVATIONS_ENV, w8_activations)  # int8: LINEAR_W8A8 in the fused step
    fused_tokens, fused_logprobs, taken = _generate(model_dir, monkeypatch, True, **quant)
    tokens, logprobs, untaken = _generate(model_dir, monkeypatch, False, **quant)
    assert untaken == 0
    assert taken >= max(MAX_TOKENS) - 1  # every decode step went through the fused call
    assert fused_tokens == tokens
    assert fused_logprobs == logprobs  # the same kernels in the same order: bit for bit


def _decode_metadata(slots: list[int], lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.arange(len(slots) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        max_seqlen_q=1, max_seqlen_k=max(lens))


def test_steps_it_cannot_take_fall_back_and_a_direct_step_matches_the_model(model_dir, monkeypatch) -> None:
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=8, max_model_len=64)
    runner = llm.engine.runner
    model, caches = runner.model, runner.kv_caches
    fused = decode_stack.build(model)
    assert fused is not None
    ids, positions = torch.tensor([3, 4]), torch.tensor([5, 20])
    md = _decode_metadata([5, 16 + 20 % 16], [6, 21], [[2, 0], [1, 3]])
    with torch.inference_mode():
        expected = model(ids, positions, [tuple(c.clone() for c in layer) for layer in caches], md)
        got = fused(ids, positions, caches, md)
    assert got is not None
    assert torch.equal(got, expected)

    prefill = AttentionMetadata(slot_mapping=torch.tensor([0, 1]), cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
                                seq_lens=torch.tensor([2], dtype=torch.int32),
                                block_tables=torch.tensor([[0]], dtype=torch.int32), max_seqlen_q=2, max_seqlen_k=2)
    bad_slot = _decode_metadata([5, 8 * 16], [6, 21], [[2, 0], [1, 3]])        # past the last block
    bad_table = _decode_metadata([5, 20], [6, 21], [[2, 0], [1, 8]])           # block 8 of 8
    too_long = _decode_metadata([5, 20], [6, 40], [[2, 0], [1, 3]])            # 40 slots > 2 blocks
    padding = _decode_metadata([5, -1], [6, 21], [[2, 0], [1, 3]])             # a skipped slot
    empty = _decode_metadata([5, 20], [0, 21], [[2, 0], [1, 3]])               # no context at all
    negative_block = _decode_metadata([5, 20], [6, 21], [[2, 0], [-1, 3]])     # a block before the first
    with torch.inference_mode():
        assert fused(torch.tensor([3, 4]), torch.tensor([0, 1]), caches, prefill) is None
        for bad in (bad_slot, bad_table, too_long, padding, empty, negative_block):
            assert fused(ids, positions, caches, bad) is None
        assert fused(ids, torch.tensor([5, fused._max_position]), caches, md) is None  # past the rope table
        assert fused(ids, torch.tensor([-1, 20]), caches, md) is None           # before it
        assert fused(ids, positions.int(), caches, md) is None                  # positions the C code cannot read
        assert fused(ids, positions, caches[:-1], md) is None                   # a cache per layer
        vocab = model.model.embed_tokens.weight.shape[0]
        assert fused(torch.tensor([3, vocab]), positions, caches, md) is None   # an id past the table
        assert fused(torch.tensor([-1, 4]), positions, caches, md) is None      # before it
        assert torch.equal(fused(ids.int(), positions, caches, md), expected)   # int32 ids: embedded in torch
        # caches it took before, one of them changed: the same memory with fewer blocks, as another
        # dtype or in another layout, or a copy in half precision, is checked again and refused
        k, v = caches[1]
        blocks, size, heads, dim = v.shape
        mixed = v.as_strided(v.shape, (size * heads * dim, heads * dim, 1, heads))
        for changed in ((k[:4], v), (k, v.view(torch.int32)), (k, mixed), (k, v.half())):
            assert fused(ids, positions, caches, md) is not None
            assert fused(ids, positions, [*caches[:1], changed, *caches[2:]], md) is None
        fresh = [tuple(torch.zeros_like(c) for c in layer) for layer in caches]  # valid caches elsewhere
        assert fused(ids, positions, caches, md) is not None
        assert fused(ids, positions, fresh, md) is not None
        assert all(bool(k.flatten(0, 1)[5].any() and v.flatten(0, 1)[20].any()) for k, v in fresh)  # written there


def test_models_and_settings_it_does_not_take(model_dir, monkeypatch) -> None:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=8, max_model_len=64)
    model = llm.engine.runner.model
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "0")
    assert decode_stack.build(model) is None
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    assert decode_stack.build(model) is not None
    model.model.layers[1].self_attn.attn.sliding_window = 8
    assert decode_stack.build(model) is None
    model.model.layers[1].self_attn.attn.sliding_window = None
    reference = LLM(str(model_dir), backend="reference", dtype="float32", block_size=16, num_kv_blocks=8,
                    max_model_len=64)
    assert decode_stack.build(reference.engine.runner.model) is None  # ground truth stays
    assert type(reference.engine.runner).__name__ == "ModelRunner"  # the generic runner, no fast paths


def _gguf_layouts(weight: torch.Tensor, scheme: str, group_size: int = -1, symmetric: bool = True,
                  smooth: torch.Tensor | None = None):
    """quantize_weight's stand-in: GGUF layouts as a .gguf file brings them (w4a16: the gguf package's
    Q4_1, fp16 scales and offsets; w8a16: its Q8_0 codes at groups of 16 with offsets, Q6_K's and
    Q5_K's shape), so the fused step meets per-group offsets and groups of 16 and 32."""
    import numpy as np

    from flashllm.ops.quant_matmul import QuantizedWeight
    from flashllm.quant.gguf_blocks import weight_from_gguf

    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType.Q4_1 if scheme == "w4a16" else gguf.GGMLQuantizationType.Q8_0
    raw = gguf.quants.quantize(weight.detach().float().numpy().astype(np.float32), qtype)
    q = weight_from_gguf(raw, qtype, tuple(weight.shape))
    if scheme == "w4a16":
        return q
    scales = q.scales.float().repeat_interleave(2, dim=1)
    return QuantizedWeight("w8a16", q.data, scales, None, 16, offsets=-0.01 * scales)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16"])
def test_fused_decode_takes_gguf_layouts_and_computes_what_the_per_op_path_does(model_dir, monkeypatch,
                                                                                 scheme) -> None:
    from flashllm.backends.cpu import quant as cpu_quant
    from flashllm.models.layers import linear

    monkeypatch.setattr(linear, "quantize_weight", _gguf_layouts)
    seen = []
    real_native = native.int_linear

    def recording(x, weight):
        seen.append((weight.offsets is not None, weight.group_size))
        return real_native(x, weight)

    monkeypatch.setattr(native, "int_linear", recording)
    monkeypatch.setattr(cpu_quant.native, "int_linear", recording)
    fused_tokens, fused_logprobs, taken = _generate(model_dir, monkeypatch, True, quant_type=scheme, group_size=32)
    tokens, logprobs, untaken = _generate(model_dir, monkeypatch, False, quant_type=scheme, group_size=32)
    assert (True, 32 if scheme == "w4a16" else 16) in seen  # the per-op path ran GGUF layouts natively
    assert untaken == 0 and taken >= max(MAX_TOKENS) - 1
    assert fused_tokens == tokens
    assert fused_logprobs == logprobs
