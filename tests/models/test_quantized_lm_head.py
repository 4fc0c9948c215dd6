"""--quantize_lm_head: the LM head (tied here) as per-channel int8 beside weight-only linears."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.layers.embedding import LMHead
from flashllm.models.weight_bytes import weight_bytes
from flashllm.quant import dequantize
from flashllm.quant.spec import QuantConfigError, weight_quant_spec
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tied-qwen2"), "qwen2", seed=3, tokenizer=False)


def _llm(model_dir: Path, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=16, max_model_len=128, **kwargs)


def _head(llm: LLM) -> LMHead:
    return next(m for m in llm.engine.parts.model.modules() if isinstance(m, LMHead))


def test_the_head_is_int8_while_the_embedding_table_stays_float(model_dir: Path) -> None:
    plain = _llm(model_dir, quant_type="w4a16", group_size=32)
    quantized = _llm(model_dir, quant_type="w4a16", group_size=32, quantize_lm_head=True)
    head, plain_head = _head(quantized), _head(plain)
    assert head.qweight.scheme == "w8a16" and head.qweight.num_groups == 1
    assert plain_head.qweight.scheme == "none"
    assert head.weight.dtype == torch.float32 and torch.equal(head.weight, plain_head.weight)
    # per-channel int8 round-to-nearest: every weight within half a step of its row's scale
    error = (dequantize(head.qweight) - head.weight).abs()
    assert bool((error <= head.qweight.scales * 0.5 + 1e-7).all())
    # the int8 copy is counted: a quarter of the fp32 table plus one fp32 scale per row
    vocab, hidden = head.weight.shape
    counted, plain_counted = weight_bytes(quantized.engine.parts.model), weight_bytes(plain.engine.parts.model)
    # the float head has the cpu backend's greedy screen (its bf16 copy and row bounds, or its int8
    # copy, scales and row bounds, kept in its kernel_cache) where the native kernels run; the int8 head has none
    assert "greedy_screen" not in head.qweight.kernel_cache
    screen = plain_head.qweight.kernel_cache.get("greedy_screen")
    per_row = {"bf16": (2, 4), "int8": (1, 8)}[screen.kind] if screen is not None else (0, 0)
    screen_bytes = vocab * hidden * per_row[0] + vocab * per_row[1]
    added = counted.total - plain_counted.total
    assert added == vocab * hidden + vocab * 4 - screen_bytes
    # a decode step streams the float table only while it is the head, and not even then where a
    # greedy screen reads its copy instead
    table = head.weight.numel() * head.weight.element_size()
    tied = head.weight.data_ptr() == quantized.engine.parts.model.model.embed_tokens.weight.data_ptr()
    head_read = table if screen is None else 0
    assert plain_counted.streamed == plain_counted.total - (table - head_read if tied else 2 * table - head_read)
    assert counted.streamed == counted.total - table


def test_quantized_head_logits_and_greedy_tokens(model_dir: Path) -> None:
    plain = _llm(model_dir, quant_type="w8a16")
    quantized = _llm(model_dir, quant_type="w8a16", quantize_lm_head=True)
    hidden = torch.randn(5, _head(plain).weight.shape[1], generator=torch.Generator().manual_seed(0))
    want, got = _head(plain)(hidden), _head(quantized)(hidden)
    # logit v's error is sum_k h_k * e_vk with |e_vk| <= scale_v / 2: at most sum_k |h_k| * scale_v / 2
    bound = hidden.abs().sum(1, keepdim=True) * _head(quantized).qweight.scales.view(1, -1) * 0.5
    assert bool(((got - want).abs() <= bound + 1e-5).all())
    assert not torch.equal(got, want)  # the head really changed
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = quantized.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8


def test_quantize_lm_head_needs_a_weight_only_scheme() -> None:
    assert weight_quant_spec("weight_only_int8", -1, lm_head=True).lm_head
    for quant_type in ("none", "a8w8", "fp8"):
        with pytest.raises(QuantConfigError, match="weight_only"):
            weight_quant_spec(quant_type, -1, lm_head=True)
