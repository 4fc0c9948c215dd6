"""The ipex backend: lazy registration everywhere; IPEX kernel edge cases and a tiny Llama where IPEX imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashllm.backends import ipex
from flashllm.ops import op_specs
from flashllm.ops.paged_attention import paged_attention as reference_paged_attention
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
