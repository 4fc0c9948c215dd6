"""The ipex backend: lazy registration everywhere; IPEX kernel edge cases and a tiny Llama where IPEX imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends import ipex
from flashllm.ops import op_specs
from flashllm.ops.paged_attention import paged_attention as reference_paged_attention
from flashllm.ops.quant_matmul import QuantizedWeight, pack_int4
from flashllm.ops.quant_matmul import quant_matmul as reference_quant_matmul
from flashllm.ops.testing import make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import OpRequest

AVAILABLE, REASON = ipex.ipex_status()
needs_ipex = pytest.mark.skipif(not AVAILABLE, reason=f"ipex backend unavailable: {REASON}")


def test_registering_backends_does_not_import_ipex() -> None:
    code = (
        "import sys; from flashllm.registry.plugins import make_plugin_manager; "
        "backends = make_plugin_manager().backends(); assert 'ipex' in backends; "
        "assert 'intel_extension_for_pytorch' not in sys.modules, 'registration imported IPEX'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.skipif(AVAILABLE, reason="IPEX is installed here")
def test_unavailable_backend_names_the_package() -> None:
    ok, reason = ipex.make_backend().is_available()
    assert not ok
    assert "pip install intel-extension-for-pytorch" in reason


@pytest.mark.parametrize(
    "request_",
    [
        OpRequest(torch.float32, torch.float32, "none", 64, 16),
        OpRequest(torch.bfloat16, torch.bfloat16, "w8a16", 128, 64),
        OpRequest(torch.float32, torch.int8, "w4a16", 64, 64),
        OpRequest(torch.float16, torch.float8_e4m3fn, "a8w8", 96, 32),
    ],
    ids=["fp32", "bf16-w8a16", "fp32-int8kv-w4a16", "fp16-fp8kv-a8w8"],
)
def test_every_op_has_a_kernel_so_selecting_ipex_never_falls_back(request_: OpRequest) -> None:
    backend = ipex.make_backend()
    for name, spec in op_specs().items():
        reasons = [k.mismatch(request_, spec.uses) for k in backend.kernels.get(name, [])]
        assert None in reasons, f"{name}: {reasons}"


def test_ipex_does_not_claim_quantized_kv_for_its_own_attention() -> None:
    backend = ipex.make_backend()
    request_ = OpRequest(torch.float32, torch.int8, "none", 64, 16)
    uses = op_specs()["paged_attention"].uses
    chosen = next(k for k in backend.kernels["paged_attention"] if k.mismatch(request_, uses) is None)
    assert chosen.backend == "cpu"


def _paged_inputs(case: str, dtype: torch.dtype, **changes: object) -> dict:
    inputs = make_inputs("paged_attention", dtype, torch.device("cpu"), head_size=64, block_size=16, case=case)
    inputs.update(changes)
    return inputs


def _check_attention(inputs: dict, dtype: torch.dtype) -> None:
    from flashllm.backends.ipex.kernels import paged_attention

    expected = run_case(reference_paged_attention, "paged_attention", inputs)
    actual = run_case(paged_attention, "paged_attention", inputs)
    rows = int(inputs["cu_seqlens_q"][-1])
    assert_close(actual[:rows], expected[:rows], dtype)


@needs_ipex
@pytest.mark.parametrize("window", [1, 3, 17])
def test_decode_sliding_window(window: int) -> None:
    _check_attention(_paged_inputs("decode", torch.float32, sliding_window=window), torch.float32)


@needs_ipex
@pytest.mark.parametrize("window", [1, 3, 17])
def test_prefill_sliding_window(window: int) -> None:
    _check_attention(_paged_inputs("mixed", torch.float32, sliding_window=window), torch.float32)


@needs_ipex
@pytest.mark.parametrize("case", ["decode", "alibi"])
def test_alibi_decode_and_mixed(case: str) -> None:
    heads = 7 if case == "decode" else 8
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(heads)])
    _check_attention(_paged_inputs(case, torch.float32, alibi_slopes=slopes), torch.float32)


@needs_ipex
def test_sequence_without_new_tokens_in_a_prefill_batch() -> None:
    inputs = _paged_inputs("mixed", torch.float32)
    cu = inputs["cu_seqlens_q"].clone()
    cu[2:] -= int(cu[2] - cu[1])  # sequence 1 brings no query tokens; its context stays
    inputs["q"] = inputs["q"][: int(cu[-1])]
    inputs["cu_seqlens_q"] = cu
    _check_attention(inputs, torch.float32)


@needs_ipex
def test_fp32_queries_over_a_bf16_cache() -> None:
    inputs = _paged_inputs("cached_prefix", torch.float32)
    inputs["k_cache"], inputs["v_cache"] = inputs["k_cache"].bfloat16(), inputs["v_cache"].bfloat16()
    _check_attention(inputs, torch.float32)


@needs_ipex
def test_non_contiguous_queries() -> None:
    inputs = _paged_inputs("mixed", torch.float32)
    wide = torch.randn(inputs["q"].shape[0], inputs["q"].shape[1], 2 * inputs["q"].shape[2])
    inputs["q"] = wide[..., ::2]
    _check_attention(inputs, torch.float32)


@needs_ipex
def test_fused_residual_returns_the_new_residual_stream() -> None:
    from flashllm.backends.ipex.kernels import rms_norm

    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    expected = op_specs()["rms_norm"].reference(x, weight, 1e-6, residual)
    assert_close(rms_norm(x.clone(), weight, 1e-6, residual.clone()), expected, torch.float32)


@needs_ipex
def test_tiny_llama_greedy_tokens_match_the_reference_backend(tmp_path: Path) -> None:
    from flashllm import LLM, SamplingParams
    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "llama", "llama", seed=3, tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 7, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "ipex"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16,
                  max_model_len=128, num_kv_blocks=32, strict_kernels=backend == "ipex")
        if backend == "ipex":
            sources = llm.engine.parts.ops.sources
            assert {sources[op] for op in ("rms_norm", "rotary_embedding", "silu_and_mul", "paged_attention")} == {"ipex"}
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens["ipex"] == tokens["reference"]


# ---- weight-only-quant linear (flashllm/backends/ipex/woq.py) ----

def _woq_weight(gen: torch.Generator, scheme: str, n: int, k: int, group_size: int, asym: bool,
                perm: bool = False) -> QuantizedWeight:
    """Random codes over the scheme's whole range, scales giving outputs of about unit size."""
    groups = 1 if group_size == -1 else k // group_size
    if scheme == "w8a16":
        data, std = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), k**-0.5 / 64
    else:
        data, std = pack_int4(torch.randint(0, 16, (n, k), generator=gen)), k**-0.5 / 4
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * std
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if asym else None
    input_perm = torch.randperm(k, generator=gen) if perm else None
    return QuantizedWeight(scheme, data, scales, zeros, group_size, input_perm=input_perm)


# scheme, group size, asymmetric (int4 zero points); w8a16 is symmetric by definition
WOQ_COMBOS = [
    ("w8a16", -1, False), ("w8a16", 32, False), ("w8a16", 128, False),
    ("w4a16", -1, False), ("w4a16", -1, True), ("w4a16", 32, False), ("w4a16", 64, True), ("w4a16", 128, True),
]


@needs_ipex
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize(("scheme", "group_size", "asym"), WOQ_COMBOS, ids=lambda v: str(v))
def test_woq_linear_matches_the_reference(scheme: str, group_size: int, asym: bool, tokens: int) -> None:
    from flashllm.backends.ipex.woq import woq_linear

    gen = torch.Generator().manual_seed(tokens)
    weight = _woq_weight(gen, scheme, 80, 256, group_size, asym)
    x, bias = torch.randn(tokens, 256, generator=gen), torch.randn(80, generator=gen)
    assert_close(woq_linear(x, weight, bias), reference_quant_matmul(x, weight, bias), torch.float32)
    assert_close(woq_linear(x, weight), reference_quant_matmul(x, weight), torch.float32)


@needs_ipex
@settings(max_examples=25, deadline=None)
@given(
    scheme=st.sampled_from(["w8a16", "w4a16"]), n=st.integers(1, 70), k_groups=st.integers(1, 4),
    group_size=st.sampled_from([-1, 32, 64, 128]), asym=st.booleans(), perm=st.booleans(),
    tokens=st.integers(0, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_woq_linear_matches_the_reference_for_any_shape(
    scheme: str, n: int, k_groups: int, group_size: int, asym: bool, perm: bool, tokens: int,
    dtype: torch.dtype, seed: int,
) -> None:
    from flashllm.backends.ipex.woq import woq_linear

    gen = torch.Generator().manual_seed(seed)
    k = k_groups * (64 if group_size == -1 else group_size)
    weight = _woq_weight(gen, scheme, n, k, group_size, asym and scheme == "w4a16", perm)
    x, bias = torch.randn(tokens, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    assert_close(woq_linear(x, weight, bias), reference_quant_matmul(x, weight, bias), dtype)


@needs_ipex
def test_woq_packs_each_weight_once() -> None:
    from flashllm.backends.ipex.woq import CACHE_KEY, woq_linear

    gen = torch.Generator().manual_seed(0)
    weight = _woq_weight(gen, "w4a16", 48, 128, 64, True)
    x = torch.randn(3, 128, generator=gen)
    first = woq_linear(x, weight)
    packed = weight.kernel_cache[CACHE_KEY]
    torch.testing.assert_close(woq_linear(x, weight), first, atol=0, rtol=0)
    assert weight.kernel_cache[CACHE_KEY] is packed


@needs_ipex
@pytest.mark.parametrize("mode", ["0", "1"])
def test_quant_matmul_routes_every_scheme(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced on or off, w8a16/w4a16 and the float weights of a quantized model match the reference."""
    from flashllm.backends.ipex.woq import CACHE_KEY, WOQ_ENV, quant_matmul

    monkeypatch.setenv(WOQ_ENV, mode)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, generator=gen)
    dense = QuantizedWeight.dense(torch.randn(40, 128, generator=gen) / 11)
    assert_close(quant_matmul(x, dense), reference_quant_matmul(x, dense), torch.float32)
    for scheme, group_size, asym in WOQ_COMBOS:
        weight = _woq_weight(gen, scheme, 40, 128, group_size, asym)
        assert_close(quant_matmul(x, weight), reference_quant_matmul(x, weight), torch.float32)
        assert (CACHE_KEY in weight.kernel_cache) == (mode == "1")


@pytest.mark.parametrize(
    ("env", "capability", "expected"),
    [(None, "AVX512", True), (None, "AVX2", False), ("auto", "DEFAULT", False), ("1", "AVX2", True), ("0", "AVX512", False)],
)
def test_woq_runs_where_ipex_vectorizes_it_unless_forced(
    env: str | None, capability: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashllm.backends.ipex.woq import WOQ_ENV, woq_enabled

    if env is None:
        monkeypatch.delenv(WOQ_ENV, raising=False)
    else:
        monkeypatch.setenv(WOQ_ENV, env)
    assert woq_enabled(capability) is expected


def test_woq_mode_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.backends.ipex.woq import WOQ_ENV, woq_enabled

    monkeypatch.setenv(WOQ_ENV, "yes")
    with pytest.raises(ValueError, match="FLASHLLM_IPEX_WOQ"):
        woq_enabled("AVX512")


@pytest.mark.parametrize("quant", ["w8a16", "w4a16"])
def test_weight_only_requests_pick_the_ipex_quant_matmul(quant: str) -> None:
    from flashllm.backends.ipex import woq

    backend = ipex.make_backend()
    request_ = OpRequest(torch.float32, torch.float32, quant, 64, 16)
    uses = op_specs()["quant_matmul"].uses
    chosen = next(k for k in backend.kernels["quant_matmul"] if k.mismatch(request_, uses) is None)
    assert (chosen.backend, chosen.fn) == ("ipex", woq.quant_matmul)
    float_request = OpRequest(torch.float32, torch.float32, "none", 64, 16)
    chosen = next(k for k in backend.kernels["quant_matmul"] if k.mismatch(float_request, uses) is None)
    assert chosen.backend == "cpu"


@needs_ipex
@pytest.mark.parametrize(("quant_type", "group_size"), [("w8a16", -1), ("w4a16", 32), ("w4a16_asym", 64)])
def test_tiny_llama_weight_only_greedy_tokens_match_the_reference_backend(
    quant_type: str, group_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashllm import LLM, SamplingParams
    from flashllm.backends.ipex.woq import CACHE_KEY, WOQ_ENV
    from flashllm.testing.tiny_models import build_tiny_model

    monkeypatch.setenv(WOQ_ENV, "1")  # IPEX's body even on CPUs where "auto" would pick the cpu kernel
    model_dir = build_tiny_model(tmp_path / "llama", "llama", seed=3, tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "ipex"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=128,
                  num_kv_blocks=32, quant_type=quant_type, group_size=group_size, strict_kernels=backend == "ipex")
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        if backend == "ipex":
            assert llm.engine.parts.ops.sources["quant_matmul"] == "ipex"
            packed = [m for m in llm.engine.parts.model.modules() if CACHE_KEY in getattr(
                getattr(m, "qweight", None), "kernel_cache", {})]
            assert packed, "no linear layer ran IPEX's WOQ linear"
    assert tokens["ipex"] == tokens["reference"]
