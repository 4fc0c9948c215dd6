"""The xla backend: lazy registration and its kernels on the CPU everywhere; on PJRT (`nox -s xla`),
the kernels on the XLA device and a tiny Llama whose decode stops compiling once its buckets are warm."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends import xla
from flashllm.backends.xla import kernels
from flashllm.ops import op_specs
from flashllm.ops.testing import case_caps, cases, make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import OpRequest

BACKEND = xla.make_backend()
AVAILABLE, REASON = BACKEND.is_available()
needs_xla = pytest.mark.skipif(not AVAILABLE, reason=f"xla backend unavailable: {REASON}")
OWN_KERNELS = ("write_kv_cache", "paged_attention", "fused_moe")
DTYPES = (torch.float32, torch.bfloat16)


def test_registering_backends_does_not_import_torch_xla() -> None:
    code = (
        "import sys; from flashllm.registry.plugins import make_plugin_manager; "
        "backends = make_plugin_manager().backends(); assert 'xla' in backends; "
        "assert 'torch_xla' not in sys.modules, 'registration imported torch_xla'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_unavailable_reason_names_the_missing_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, reason = xla.xla_status.__wrapped__(None)
    assert not ok
    if importlib.util.find_spec("torch_xla") is None:
        assert "torch_xla is not installed" in reason and "pip install 'torch==2.9.*' 'torch-xla==2.9.*'" in reason
    else:
        assert "PJRT_DEVICE is not set" in reason
    monkeypatch.setattr(xla.importlib.metadata, "version", lambda name: "1.0.0")
    ok, reason = xla.xla_status.__wrapped__("CPU")
    assert not ok and "torch_xla 1.0.0 needs torch 1.0.*" in reason


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_has_a_kernel_so_selecting_xla_never_falls_back(dtype: torch.dtype) -> None:
    request = OpRequest(dtype, dtype, "none", 64, 16)
    for name, spec in op_specs().items():
        assert [k.mismatch(request, spec.uses) for k in BACKEND.kernels[name]] == [None], name


@pytest.mark.parametrize("request_", [
    OpRequest(torch.float16, torch.float16, "none", 64, 16),
    OpRequest(torch.float32, torch.int8, "none", 64, 16),
    OpRequest(torch.bfloat16, torch.bfloat16, "w8a16", 64, 16),
], ids=["fp16", "int8-kv", "w8a16"])
def test_claims_stop_at_float32_bfloat16_float_kv_and_no_quantization(request_: OpRequest) -> None:
    uses = {name: spec.uses for name, spec in op_specs().items()}
    refused = [name for name, ks in BACKEND.kernels.items() if all(k.mismatch(request_, uses[name]) for k in ks)]
    assert refused


def _compare(op: str, dtype: torch.dtype, case: str, device: torch.device) -> None:
    """The xla kernel on `device` against the op reference on the CPU, from the same seed."""
    expected = run_case(op_specs()[op].reference, op, make_inputs(op, dtype, "cpu", case=case))
    inputs = make_inputs(op, dtype, device, case=case)
    actual = run_case(getattr(kernels, op), op, inputs)
    actual = tuple(t.cpu() for t in actual) if isinstance(actual, tuple) else actual.cpu()
    if op == "paged_attention":  # rows past cu_seqlens_q[-1] are unspecified
        rows = int(inputs["cu_seqlens_q"][-1])
        actual, expected = actual[:rows], expected[:rows]
    assert_close(actual, expected, dtype)


def _float_cases(op: str) -> list[str]:
    """Float-cache cases, less those needing a capability the xla kernel does not claim (score caps, sinks)."""
    return [c for c in cases(op) if make_inputs(op, torch.float32, case=c).get("k_scale") is None
            and not {"softcap", "sinks"} & case_caps(op, c)]


CASES = [pytest.param(op, dtype, case, id=f"{op}-{str(dtype)[6:]}-{case}")
         for op in OWN_KERNELS for dtype in DTYPES for case in _float_cases(op)]


@pytest.mark.parametrize(("op", "dtype", "case"), CASES)
def test_kernels_match_the_reference_on_the_cpu(op: str, dtype: torch.dtype, case: str) -> None:
    _compare(op, dtype, case, torch.device("cpu"))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_tokens=st.integers(1, 12))
def test_padding_slots_never_change_the_cache(data: st.DataObject, num_tokens: int) -> None:
    """Any mix of real slots (distinct) and -1 padding, slot 0 included: exactly the real writes land."""
    num_blocks, block_size, heads, dim = 4, 4, 2, 3
    real = data.draw(st.lists(st.integers(0, num_blocks * block_size - 1), max_size=num_tokens, unique=True))
    slots = real + [-1] * (num_tokens - len(real))
    slots = data.draw(st.permutations(slots))
    k, v = torch.randn(num_tokens, heads, dim), torch.randn(num_tokens, heads, dim)
    caches = [torch.randn(num_blocks, block_size, heads, dim) for _ in range(2)]
    want = [c.clone() for c in caches]
    for t, slot in enumerate(slots):  # the naive loop the op contract describes
        if slot >= 0:
            want[0][slot // block_size, slot % block_size] = k[t]
            want[1][slot // block_size, slot % block_size] = v[t]
    kernels.write_kv_cache(k, v, *caches, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def test_devices_command_shows_the_xla_row_with_reason_and_proof(capsys: pytest.CaptureFixture[str]) -> None:
    from flashllm.cli import main

    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    backend = next(b for b in data["backends"] if b["name"] == "xla")
    rows = [r for r in data["matrix"] if r["backend"] == "xla"]
    assert backend["proof"] == "conformance" and backend["available"] == AVAILABLE
    assert [r["device"] for r in rows] == ["XLA (PJRT CPU)"] and rows[0]["proof"] == "conformance"
    assert {k for k, c in rows[0]["cells"].items() if c["status"] == "native"} == {"fp32", "bf16"}
    if AVAILABLE:
        assert backend["device_profile_here"] == "XLA (PJRT CPU)" and rows[0]["here"]
    else:
        assert backend["reason"] == REASON and rows[0]["reason"] == REASON


# --- on the XLA device (PJRT_DEVICE=CPU in `nox -s xla`) --------------------------------------------

@needs_xla
@pytest.mark.parametrize(("op", "dtype", "case"), CASES)
def test_kernels_match_the_reference_on_the_xla_device(op: str, dtype: torch.dtype, case: str) -> None:
    _compare(op, dtype, case, torch.device("xla"))


def _compilations() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


@needs_xla
def test_tiny_llama_matches_the_reference_and_decode_stops_compiling(tmp_path: Path) -> None:
    from flashllm import LLM, SamplingParams
    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "llama", "llama", seed=3, tokenizer=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 7, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engines = {backend: LLM(str(model_dir), dtype="float32", device=device, backend=backend, block_size=16,
                            max_model_len=128, num_kv_blocks=32, strict_kernels=True)
               for backend, device in (("reference", "cpu"), ("xla", "xla"))}
    llm = engines["xla"]
    assert set(llm.engine.parts.ops.sources.values()) == {"xla"}
    assert llm.engine.runner.shape_buckets is not None, (
        "the engine's ModelRunner got no shape buckets: core/builder.py must pass adapter=selection.adapter")
    tokens = {name: [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
              for name, engine in engines.items()}
    assert tokens["xla"] == tokens["reference"]

    # two sequences whose prompts and contexts stay inside one bucket of each size
    def decode(seed: int, max_tokens: int) -> None:
        pair = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist() for n in (5, 6)]
        llm.generate(pair, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    before = _compilations()
    decode(1, 4)
    warm = _compilations()
    assert warm > before, "the warm-up compiled nothing: is the model running on the XLA device?"
    decode(2, 40)  # ten times the decode steps, other tokens, the same buckets
    assert _compilations() == warm, f"{_compilations() - warm} new XLA compilations after warm-up"


@needs_xla
def test_pjrt_cpu_client_reports_itself_and_host_memory() -> None:
    assert os.environ.get("PJRT_DEVICE") == "CPU"
    assert REASON.endswith("PJRT CPU device(s)")
    adapter = BACKEND.adapter()
    free, total = adapter.memory_info(torch.device("xla"))
    assert 0 < free <= total
    adapter.synchronize(torch.device("xla"))
