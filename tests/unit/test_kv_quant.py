"""Quantized (int8 / fp8 e4m3) KV caches: the ops against hand-written quantize loops, and their plumbing."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.cpu.kernels import paged_attention as cpu_paged_attention
from flashllm.core.builder import EngineConfigError, kv_cache_dtype
from flashllm.core.model_runner import ModelRunner
from flashllm.models.layers.attention import Attention
from flashllm.ops.paged_attention import paged_attention
from flashllm.ops.write_kv_cache import write_kv_cache
from flashllm.registry.backend import OpRequest
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.precision import DeviceProfile
from flashllm.registry.resolve import PrecisionError, check_precision, resolve_ops, select_device

INT8, FP8 = torch.int8, torch.float8_e4m3fn
QMAX = {INT8: 127, FP8: 448}  # symmetric int8; the largest finite e4m3fn value, 1.75 * 2**8


def f32(value: float) -> float:
    """value rounded to the nearest float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _e4m3_values() -> list[float]:
    """Every finite non-negative e4m3fn value from its bit layout: 4 exponent bits (bias 7), 3 mantissa bits."""
    values = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals (exponent field 0)
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return values[:-1]  # exponent 15 with mantissa 7 is NaN in the "fn" variant


E4M3 = _e4m3_values()


def naive_e4m3(x: float) -> float:
    """Round x to the nearest e4m3fn value, ties to the even mantissa, saturating at +-448."""
    magnitude = min(abs(x), 448.0)
    best = min(range(len(E4M3)), key=lambda i: (abs(E4M3[i] - magnitude), i % 2))
    return math.copysign(E4M3[best], x)


def naive_quantize_row(row: list[float], dtype: torch.dtype, scale: float | None) -> tuple[list[float], float]:
    """Codes and scale of one head's vector: dynamic (scale None) or with a fixed fp32 scale."""
    if scale is None:
        scale = max(f32(max(abs(x) for x in row) / QMAX[dtype]), 1e-10)
    codes = []
    for x in row:
        q = f32(x / scale)  # the op divides in fp32
        if dtype == INT8:
            codes.append(float(max(-127, min(127, round(q)))))  # Python rounds half to even
        else:
            codes.append(naive_e4m3(q))
    return codes, scale


def _write_case(gen: torch.Generator, kv_dtype: torch.dtype, static: str | None, std: float = 1.0):
    num_blocks, block_size, heads, dim = 3, 4, 2, 8
    slots = torch.tensor([5, -1, 0, 11, 6])
    k = torch.randn(5, heads, dim, generator=gen) * std
    v = torch.randn(5, heads, dim, generator=gen) * std
    shape = (num_blocks, block_size, heads, dim)
    caches = [torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)]
    if static is None:
        scales = [torch.full(shape[:3], 7.0), torch.full(shape[:3], 7.0)]
    else:
        size = () if static == "scalar" else (heads,)
        scales = [torch.rand(size, generator=gen) * 2 / QMAX[kv_dtype] + 0.004 for _ in range(2)]
    return k, v, slots, caches, scales


@pytest.mark.parametrize("kv_dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("static", [None, "heads", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_naive_quantize_loops(kv_dtype, static, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k, v, slots, caches, scales = _write_case(gen, kv_dtype, static)
    k, v = k.to(dtype), v.to(dtype)
    untouched = [c.clone() for c in caches], [s.clone() for s in scales]
    write_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    block_size = caches[0].shape[1]
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        written.add((b, o))
        for x, cache, scale in ((k, caches[0], scales[0]), (v, caches[1], scales[1])):
            for h in range(x.shape[1]):
                fixed = None if static is None else float(scale.reshape(-1)[h if scale.dim() else 0])
                codes, expected_scale = naive_quantize_row(x[t, h].float().tolist(), kv_dtype, fixed)
                assert cache[b, o, h].float().tolist() == codes
                if static is None:
                    assert float(scale[b, o, h]) == expected_scale
    for before, after in zip(untouched[0], caches, strict=True):
        for b, o in {(b, o) for b in range(3) for o in range(block_size)} - written:
            assert torch.equal(after[b, o].float(), before[b, o].float())
    if static is None:  # unwritten slots keep their scales
        for before, after in zip(untouched[1], scales, strict=True):
            mask = torch.ones(after.shape[:2], dtype=torch.bool)
            for b, o in written:
                mask[b, o] = False
            assert torch.equal(after[mask], before[mask])
    else:  # static scales are read-only
        assert all(torch.equal(a, b) for a, b in zip(untouched[1], scales, strict=True))


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, allow_subnormal=False, width=32), min_size=8, max_size=8),
    exponent=st.integers(-20, 10),
)
def test_int8_dynamic_error_is_at_most_half_a_scale(values: list[float], exponent: int) -> None:
    x = torch.tensor(values).view(1, 1, 8) * 2.0**exponent
    cache, scale = torch.zeros(1, 2, 1, 8, dtype=INT8), torch.ones(1, 2, 1)
    write_kv_cache(x, x, cache, cache.clone(), torch.tensor([1]), scale, scale.clone())
    s = float(scale[0, 1, 0])
    assert s > 0
    dequant = cache[0, 1, 0].float() * s
    # round to nearest: within half a step, plus fp32 rounding of x / scale (|x / s| <= 127)
    assert float((dequant - x[0, 0]).abs().max()) <= s / 2 * (1 + 1e-5)
    if float(x.abs().max()) / 127 > 1e-10:  # above the scale floor the largest element maps to +-127
        assert int(cache[0, 1, 0].abs().max()) == 127


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(-1e3, 1e3, allow_subnormal=False, width=32), min_size=8, max_size=8))
def test_fp8_dynamic_relative_error_is_at_most_half_an_e4m3_ulp(values: list[float]) -> None:
    x = torch.tensor(values).view(1, 1, 8)
    cache, scale = torch.zeros(1, 1, 1, 8, dtype=FP8), torch.ones(1, 1, 1)
    write_kv_cache(x, x, cache, cache.clone(), torch.tensor([0]), scale, scale.clone())
    s = float(scale[0, 0, 0])
    error = (cache[0, 0, 0].float() * s - x[0, 0]).abs()
    # 3 mantissa bits: half an ulp is 2**-4 of the value; subnormal codes (< 2**-6) step by 2**-9
    bound = torch.maximum(x[0, 0].abs() * 2.0**-4, torch.tensor(s * 2.0**-10)) * (1 + 1e-5)
    assert bool((error <= bound).all())


def test_static_scales_saturate_and_zero_heads_dequantize_to_zero() -> None:
    x = torch.tensor([[[-5.0, -1.0, 0.0, 0.5, 3.0]], [[0.0] * 5]])  # (2 tokens, 1 head, 5)
    for kv_dtype in (INT8, FP8):
        cache = torch.zeros(1, 2, 1, 5, dtype=kv_dtype)
        scale = torch.tensor([2.0 / QMAX[kv_dtype]])  # range +-2
        write_kv_cache(x, x, cache, cache.clone(), torch.tensor([0, 1]), scale, scale)
        dequant = cache[0, 0, 0].float() * scale
        torch.testing.assert_close(dequant[[0, 4]], torch.tensor([-2.0, 2.0]))
        dynamic = torch.ones(1, 2, 1)
        write_kv_cache(x, x, cache, cache.clone(), torch.tensor([0, 1]), dynamic, dynamic.clone())
        assert float(dynamic[0, 1, 0]) > 0 and not cache[0, 1].float().any()


def _random_quantized_cache(gen: torch.Generator, kv_dtype: torch.dtype, static: bool):
    num_blocks, block_size, heads, dim = 6, 4, 2, 8
    shape = (num_blocks, block_size, heads, dim)
    if kv_dtype == INT8:
        codes = [torch.randint(-127, 128, shape, generator=gen, dtype=INT8) for _ in range(2)]
    else:
        codes = [(torch.randn(shape, generator=gen) * 100).to(FP8) for _ in range(2)]
    scale_shape = (heads,) if static else shape[:3]
    scales = [torch.rand(scale_shape, generator=gen) / 50 + 1e-3 for _ in range(2)]
    return codes, scales


def naive_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Loop over (block, offset, head): code * that slot's (dynamic) or that head's (static) scale."""
    out = torch.empty(codes.shape)
    for b in range(codes.shape[0]):
        for o in range(codes.shape[1]):
            for h in range(codes.shape[2]):
                s = scale[b, o, h] if scale.dim() == 3 else scale[h]
                out[b, o, h] = torch.tensor([float(c) * float(s) for c in codes[b, o, h].float().tolist()])
    return out


@pytest.mark.parametrize("kernel", [paged_attention, cpu_paged_attention], ids=["reference", "cpu"])
@pytest.mark.parametrize("kv_dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_paged_attention_equals_attention_over_naively_dequantized_cache(kernel, kv_dtype, static) -> None:
    gen = torch.Generator().manual_seed(2)
    (k_codes, v_codes), (k_scale, v_scale) = _random_quantized_cache(gen, kv_dtype, static)
    q = torch.randn(1 + 5 + 1, 4, 8, generator=gen)  # decode, a prefill chunk after a prefix, decode
    args = {
        "block_tables": torch.tensor([[3, 0, 0], [5, 1, 4], [2, 0, 0]], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 1, 6, 7], dtype=torch.int32),
        "seq_lens": torch.tensor([3, 11, 4], dtype=torch.int32),
        "scale": 8**-0.5,
    }
    out = kernel(q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, **args)
    # the float path of the reference is checked against naive attention in test_ops_attention
    expected = paged_attention(q, naive_dequantize(k_codes, k_scale), naive_dequantize(v_codes, v_scale), **args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    half = kernel(q.to(torch.bfloat16), k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, **args)
    assert half.dtype == torch.bfloat16  # math in fp32, then one rounding to bf16
    torch.testing.assert_close(half.float(), expected, atol=1e-2, rtol=1.6e-2)


def test_int8_write_then_attend_stays_close_to_float_attention() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim, block_size = 9, 2, 16, 4
    k, v = torch.randn(tokens, heads, dim, generator=gen), torch.randn(tokens, heads, dim, generator=gen)
    q = torch.randn(tokens, 4, dim, generator=gen)
    shape = (3, block_size, heads, dim)
    args = {"block_tables": torch.tensor([[2, 0, 1]], dtype=torch.int32),
            "cu_seqlens_q": torch.tensor([0, tokens], dtype=torch.int32),
            "seq_lens": torch.tensor([tokens], dtype=torch.int32), "scale": dim**-0.5}
    slots = torch.tensor([2 * block_size + i if i < 4 else (i - 4) + (0 if i < 8 else block_size) for i in range(tokens)])
    float_caches = torch.zeros(shape), torch.zeros(shape)
    write_kv_cache(k, v, *float_caches, slots)
    int8_caches = torch.zeros(shape, dtype=INT8), torch.zeros(shape, dtype=INT8)
    scales = torch.ones(shape[:3]), torch.ones(shape[:3])
    write_kv_cache(k, v, *int8_caches, slots, *scales)
    exact = paged_attention(q, *float_caches, **args)
    approx = paged_attention(q, *int8_caches, k_scale=scales[0], v_scale=scales[1], **args)
    # per-element K/V error <= max|x| / 254 ~ 1% of N(0,1) maxima; outputs are averages of V rows
    assert float((approx - exact).abs().max()) < 0.05


def test_scale_and_cache_mismatches_are_value_errors() -> None:
    q, table = torch.randn(1, 2, 8), torch.zeros(1, 1, dtype=torch.int32)
    meta = {"block_tables": table, "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32),
            "seq_lens": torch.tensor([1], dtype=torch.int32), "scale": 1.0}
    float_cache, int8_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8, dtype=INT8)
    dynamic, static = torch.ones(2, 4, 1), torch.ones(1)
    bad = [
        (float_cache, dynamic, dynamic, "float"),
        (int8_cache, None, None, "needs both"),
        (int8_cache, dynamic, None, "needs both"),
        (int8_cache, dynamic, static, "mix dynamic"),
        (int8_cache, torch.ones(2, 4, 3), torch.ones(2, 4, 3), "shape"),
        (int8_cache, static.half(), static.half(), "float32"),
        (torch.zeros(2, 4, 1, 8, dtype=torch.uint8), static, static, "not supported"),
    ]
    for cache, k_scale, v_scale, message in bad:
        with pytest.raises(ValueError, match=message):
            paged_attention(q, cache, cache, k_scale=k_scale, v_scale=v_scale, **meta)
        with pytest.raises(ValueError, match=message):
            write_kv_cache(q[:, :1], q[:, :1], cache, cache.clone(), torch.tensor([0]), k_scale, v_scale)


def test_kv_cache_dtype_names() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("int8", torch.float32) == INT8
    assert kv_cache_dtype("FP8", torch.float32) == kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    assert kv_cache_dtype("fp16", torch.float32) == torch.float16
    with pytest.raises(EngineConfigError, match="--kv-cache-dtype 'int4'"):
        kv_cache_dtype("int4", torch.float32)


class _TinyModel(torch.nn.Module):
    def __init__(self, num_layers: int, heads: int, dim: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Attention(heads, dim, 1.0, heads, _Ops()) for _ in range(num_layers))
        self.shape = (num_layers, heads, dim)

    def kv_cache_shape(self) -> tuple[int, int, int]:
        return self.shape

    def kv_cache_scales(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        return [(attn.k_scale, attn.v_scale) for attn in self.layers]


class _Ops:
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention = staticmethod(paged_attention)


@pytest.mark.parametrize(("kv_dtype", "mode", "element_bytes", "scale_bytes"), [
    (torch.float32, "dynamic", 4, 0), (torch.bfloat16, "static", 2, 0),
    (INT8, "dynamic", 1, 4), (FP8, "dynamic", 1, 4), (INT8, "static", 1, 0),
])
def test_kv_bytes_per_block_counts_what_the_runner_allocates(kv_dtype, mode, element_bytes, scale_bytes) -> None:
    layers, heads, dim, block_size, num_blocks = 3, 2, 16, 4, 5
    model = _TinyModel(layers, heads, dim)
    for attn in model.layers:
        attn.load_kv_scale("k_scale", torch.tensor(0.5))
        attn.load_kv_scale("v_scale", torch.tensor([0.5, 0.25]))
    per_block = ModelRunner.kv_bytes_per_block(model, block_size, kv_dtype, mode)
    # K and V per layer per slot: heads * dim elements, plus one fp32 scale per head when dynamic
    assert per_block == 2 * layers * block_size * heads * (dim * element_bytes + scale_bytes)
    runner = ModelRunner(model, torch.device("cpu"), num_blocks, block_size, kv_dtype, mode)
    static_bytes = 2 * layers * 4 * 1.5 if (kv_dtype.itemsize == 1 and mode == "static") else 0  # () + (2,)
    assert runner.kv_cache_bytes() == per_block * num_blocks + static_bytes


def test_static_mode_without_checkpoint_scales_says_what_to_do() -> None:
    model = _TinyModel(2, 2, 8)
    model.layers[0].load_kv_scale("k_scale", torch.tensor(0.5))
    model.layers[0].load_kv_scale("v_scale", torch.tensor(0.5))
    with pytest.raises(ValueError, match=r"layer 1 .*--kv-scales.*--cachekv_int8_type dynamic"):
        ModelRunner(model, torch.device("cpu"), 2, 4, INT8, "static")
    with pytest.raises(ValueError, match="shape"):
        model.layers[1].load_kv_scale("k_scale", torch.ones(3))
    with pytest.raises(ValueError, match="positive"):
        model.layers[1].load_kv_scale("v_scale", torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="cachekv_int8_type"):
        ModelRunner(model, torch.device("cpu"), 2, 4, INT8, "per_channel")


@pytest.mark.parametrize("kv_dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_cpu_resolves_quantized_kv_without_fallbacks_and_cuda_does_not_claim_it(kv_dtype) -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    selection = select_device("cpu", plugins=plugins)
    table = resolve_ops(selection, OpRequest(torch.float32, kv_dtype, "none", 64, 16), plugins=plugins, strict=True)
    assert table.sources["paged_attention"] == "cpu" and not table.fallbacks
    cuda = plugins.backends()["cuda"]
    for op in ("write_kv_cache", "paged_attention"):
        for kernel in cuda.kernels[op]:
            reason = kernel.mismatch(OpRequest(torch.float16, kv_dtype, "none", 64, 16), frozenset({"kv_dtype"}))
            assert reason is not None and str(kv_dtype).removeprefix("torch.") in reason


def test_a_device_without_the_kv_dtype_names_what_it_supports() -> None:
    plugins = make_plugin_manager(load_entry_points=False)
    selection = select_device("cpu", plugins=plugins)
    profile = DeviceProfile("old GPU", frozenset({torch.float16}), kv_dtypes=frozenset({INT8}))
    narrowed = type(selection)(selection.device, selection.backend, profile, selection.adapter)
    with pytest.raises(PrecisionError, match="KV cache dtype float8_e4m3fn is not supported.*supported: int8"):
        check_precision(narrowed, torch.float16, "none", FP8)


def test_cli_flags_take_both_spellings() -> None:
    import argparse

    from flashllm.cli import predict, serve

    parser = argparse.ArgumentParser()
    predict.configure(parser)
    for flag in ("--cachekv_int8_type", "--cachekv-int8-type"):
        args = parser.parse_args(["--kv_cache_dtype", "fp8", flag, "static"])
        assert (args.kv_cache_dtype, args.cachekv_int8_type) == ("fp8", "static")
    sub = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(sub)
    serve_parser = sub.choices["serve"]
    for flag in ("--cachekv_int8_type", "--cachekv-int8-type"):
        args = serve_parser.parse_args(["--kv-cache-dtype", "int8", flag, "static"])
        options = serve.resolve_options(args, environ={})
        assert (options["kv_cache_dtype"], options["cachekv_int8_type"]) == ("int8", "static")


def test_serve_hands_the_kv_options_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from flashllm.cli import serve
    from flashllm.serving import server

    sub = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(sub)
    options = serve.resolve_options(sub.choices["serve"].parse_args([]), environ={"FLASHLLM_KV_CACHE_DTYPE": "fp8"})
    monkeypatch.setattr(server, "Engine", lambda config: config)
    cache = server._build_engine(options).cache
    assert (cache.kv_cache_dtype, cache.cachekv_int8_type) == ("fp8", "dynamic")


class _LLMCalled(Exception):
    """Raised by a stand-in LLM to stop a command once it has its engine options."""


@pytest.mark.parametrize("argv", [
    ["predict", "--benchmark", "--kv_cache_dtype", "int8", "--cachekv_int8_type", "static"],
    ["bench", "throughput", "--model", "m", "--max-model-len", "64", "--kv-cache-dtype", "int8",
     "--cachekv-int8-type", "static"],
])
def test_commands_hand_the_kv_flags_to_the_engine(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    import flashllm.llm
    from flashllm.cli import main

    seen: dict = {}

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise _LLMCalled

    monkeypatch.setattr(flashllm.llm, "LLM", fake_llm)
    with pytest.raises(_LLMCalled):
        main(argv)
    assert (seen["kv_cache_dtype"], seen["cachekv_int8_type"]) == ("int8", "static")
