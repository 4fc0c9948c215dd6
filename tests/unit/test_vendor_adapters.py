"""Vendor adapters (npu, xpu, dcu, gcu) against recording fakes of the vendor packages.

The fakes implement the documented torch_npu signatures exactly (keyword names included, so a
wrong argument name is a TypeError) and compute with naive loops written here, independent of
flashllm's op references; kernels are then compared with the references within tolerances.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest
import torch

from flashllm.backends import dcu, gcu, npu, xpu
from flashllm.backends.npu import kernels as npu_kernels
from flashllm.backends.xpu import native
from flashllm.ops import op_specs
from flashllm.ops.testing import case_caps, case_quant, cases, claims, make_inputs, run_case
from flashllm.ops.tolerances import assert_close
from flashllm.registry.backend import PROOF_LEVELS, Backend, OpRequest
from flashllm.registry.plugins import make_plugin_manager
from flashllm.registry.resolve import DeviceSelection, PrecisionError, check_precision, resolve_ops, select_device

HALF = (torch.float16, torch.bfloat16)
ALL = (torch.float32, *HALF)


def _paged_rows(cache: torch.Tensor, block_row: torch.Tensor, length: int, heads: int) -> torch.Tensor:
    """Token j of a sequence is slot j % block_size of block block_row[j // block_size]: (length, heads, D)."""
    block_size = cache.shape[1]
    rows = [cache[int(block_row[j // block_size]), j % block_size] for j in range(length)]
    return torch.stack(rows).view(length, heads, -1).float()


def _naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q (n, Hq, D), keys/values (L, Hk, D), visible (n, L) bool -> (n, Hq, D) fp32, one head at a time."""
    out = torch.zeros(q.shape)
    group = q.shape[1] // keys.shape[1]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            scores = (keys[:, h // group] @ q[i, h].float()) * scale
            probs = torch.softmax(scores.masked_fill(~visible[i], -math.inf), dim=0)
            out[i, h] = probs @ values[:, h // group]
    return out


class FakeTorchNpu(types.ModuleType):
    """torch_npu with the documented signatures of the ops flashllm maps; records every call."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.__version__ = "7.0.0+fake"
        self.calls: list[tuple[str, dict]] = []

    def named(self, op: str) -> list[dict]:
        return [kwargs for name, kwargs in self.calls if name == op]

    def npu_rms_norm(self, self_, gamma, epsilon=1e-06):
        self.calls.append(("npu_rms_norm", {"x": self_, "gamma": gamma, "epsilon": epsilon}))
        assert gamma.dtype == self_.dtype, "gamma must share the input dtype"
        x = self_.float()
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        return (x * rstd * gamma.float()).to(self_.dtype), rstd

    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half"):  # noqa: A002 - the documented name
        self.calls.append(("npu_rotary_mul", {"input": input, "r1": r1, "r2": r2, "rotary_mode": rotary_mode}))
        assert input.dim() == r1.dim() == r2.dim() == 4 and rotary_mode in ("half", "interleave")
        if rotary_mode == "half":
            x1, x2 = input.chunk(2, dim=-1)
            turned = torch.cat((-x2, x1), dim=-1)
        else:
            turned = torch.stack((-input[..., 1::2], input[..., 0::2]), dim=-1).flatten(-2)
        return r1 * input + r2 * turned

    def npu_incre_flash_attention(self, query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                                  actual_seq_lengths=None, antiquant_scale=None, antiquant_offset=None,
                                  block_table=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
                                  quant_scale2=None, quant_offset2=None, kv_padding_size=None, num_heads=1,
                                  scale_value=1.0, input_layout="BSH", num_key_value_heads=0, block_size=0,
                                  inner_precise=1):
        self.calls.append(("npu_incre_flash_attention", dict(
            query=query, key=key, actual_seq_lengths=actual_seq_lengths, block_table=block_table,
            num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale_value=scale_value,
            input_layout=input_layout, block_size=block_size)))
        assert input_layout == "BSH" and query.shape[1] == 1 and block_table.dtype == torch.int32
        assert key.shape[1] == block_size and isinstance(actual_seq_lengths, list)
        out = torch.zeros(query.shape)
        for b, length in enumerate(actual_seq_lengths):
            keys = _paged_rows(key, block_table[b], length, num_key_value_heads)
            values = _paged_rows(value, block_table[b], length, num_key_value_heads)
            q = query[b].view(1, num_heads, -1)
            out[b, 0] = _naive_attention(q, keys, values, torch.ones(1, length, dtype=torch.bool), scale_value).flatten()
        return out.to(query.dtype)

    def npu_fused_infer_attention_score(self, query, key, value, *, pse_shift=None, atten_mask=None,
                                        actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
                                        num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                                        input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                                        block_size=0, softmax_lse_flag=False):
        self.calls.append(("npu_fused_infer_attention_score", dict(
            query=query, key=key, atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
            actual_seq_lengths_kv=actual_seq_lengths_kv, block_table=block_table, num_heads=num_heads,
            num_key_value_heads=num_key_value_heads, scale=scale, input_layout=input_layout,
            sparse_mode=sparse_mode, block_size=block_size)))
        assert input_layout == "BSH" and block_table.dtype == torch.int32 and atten_mask.dtype == torch.bool
        out = torch.zeros(query.shape)
        for b, (q_len, kv_len) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv, strict=True)):
            keys = _paged_rows(key, block_table[b], kv_len, num_key_value_heads)
            values = _paged_rows(value, block_table[b], kv_len, num_key_value_heads)
            visible = ~atten_mask[b, 0, :q_len, :kv_len]
            q = query[b, :q_len].view(q_len, num_heads, -1)
            out[b, :q_len] = _naive_attention(q, keys, values, visible, scale).flatten(1)
        return out.to(query.dtype), torch.empty(0)

    def npu_convert_weight_to_int4pack(self, weight, inner_k_tiles=0):
        self.calls.append(("npu_convert_weight_to_int4pack", {"weight": weight}))
        assert weight.dtype == torch.int32 and weight.shape[1] % 8 == 0 and int(weight.abs().max()) <= 8
        nibbles = (weight.long() & 0xF).view(weight.shape[0], -1, 8)
        packed = sum(nibbles[..., i] << (4 * i) for i in range(8))
        return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement int32

    @staticmethod
    def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
        bits = packed.long() & 0xFFFFFFFF
        nibbles = torch.stack([(bits >> (4 * i)) & 0xF for i in range(8)], dim=-1).flatten(1)
        return torch.where(nibbles >= 8, nibbles - 16, nibbles)

    def npu_weight_quant_batchmatmul(self, x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
        self.calls.append(("npu_weight_quant_batchmatmul", dict(
            x=x, weight=weight, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset, bias=bias,
            antiquant_group_size=antiquant_group_size)))
        assert x.dtype in HALF and antiquant_scale.dtype == x.dtype and weight.dtype in (torch.int8, torch.int32)
        w = (self._unpack_int4(weight) if weight.dtype == torch.int32 else weight).float()  # (K, N)
        expand = (lambda t: t.float().repeat_interleave(antiquant_group_size, 0)) if antiquant_group_size else (
            lambda t: t.float().reshape(1, -1))
        if antiquant_offset is not None:
            w = w + expand(antiquant_offset)
        y = x.float() @ (w * expand(antiquant_scale))
        return (y if bias is None else y + bias.float()).to(x.dtype)


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    """A fake torch_npu in sys.modules and a torch.npu namespace reporting one Ascend 910B."""
    return install_fake_npu(monkeypatch)


def install_fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda index=0: "Ascend910B3",
    ), raising=False)
    return fake


def _kernel(backend: Backend, op: str, dtype: torch.dtype, quant: str = "none"):
    """The backend's kernel for a float-KV request at head size 64 / block size 16, or None if none claims it."""
    request = OpRequest(dtype, dtype, quant, 64, 16)
    uses = op_specs()[op].uses
    return next((k.fn for k in backend.kernels[op] if k.mismatch(request, uses) is None), None)


def _float_kv(inputs: dict) -> bool:
    """Whether a case uses a float KV cache (quantized-cache cases are claimed by no adapter kernel)."""
    cache = inputs.get("k_cache")
    return cache is None or (cache.dtype.is_floating_point and cache.dtype.itemsize > 1)


# --- availability and imports -------------------------------------------------------------------

def test_importing_flashllm_and_registering_backends_imports_no_vendor_sdk() -> None:
    code = (
        "import sys, flashllm\n"
        "from flashllm.registry.plugins import make_plugin_manager\n"
        "from flashllm.registry.matrix import render_markdown\n"
        "render_markdown(make_plugin_manager(load_entry_points=False))\n"
        "vendors = ('torch_npu', 'torch_gcu', 'triton', 'intel_extension_for_pytorch')\n"
        "print(__import__('json').dumps([m for m in vendors if m in sys.modules]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize(("module", "make", "package"), [
    ("torch_npu", npu.make_backend, "pip install torch-npu"),
    ("torch_gcu", gcu.make_backend, "torch_gcu wheel"),
])
def test_is_available_names_the_missing_vendor_package(monkeypatch, module, make, package) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if the package were absent
    ok, reason = make().is_available()
    assert not ok and f"{module} is not installed" in reason and package in reason


def test_xpu_and_dcu_explain_why_they_are_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    ok, reason = xpu.make_backend().is_available()
    assert not ok and "no Intel GPU" in reason and "download.pytorch.org/whl/xpu" in reason
    monkeypatch.setattr(torch.version, "hip", None)
    ok, reason = dcu.make_backend().is_available()
    assert not ok and "not a ROCm build" in reason
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, reason = dcu.make_backend().is_available()
    assert not ok and "sees no DCU" in reason


def test_device_npu_on_this_machine_fails_in_one_line(tmp_path, capsys) -> None:
    from flashllm.cli import main

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"src": "hi"}) + "\n")
    assert main(["predict", "--device", "npu", "--data_file", str(data), "--output_file", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch_npu is not installed" in err[0] and "pip install torch-npu" in err[0]


# --- proof levels ---------------------------------------------------------------------------------

def test_every_builtin_backend_declares_a_known_proof_level() -> None:
    backends = make_plugin_manager(load_entry_points=False).backends()
    levels = {name: b.proof for name, b in backends.items()}
    assert set(levels.values()) <= set(PROOF_LEVELS)
    assert {levels[n] for n in ("npu", "xpu", "dcu", "gcu")} == {"mapped"}
    assert levels["reference"] == levels["cpu"] == "conformance" and levels["cuda"] == "interpreter"
    assert "gpu" not in levels.values()  # nothing has run on a GPU in CI yet
    assert Backend("third_party", "cpu", 1).proof == "mapped"
    with pytest.raises(ValueError, match="proof level 'proven'"):
        Backend("bad", "cpu", 1, proof="proven")


# --- npu: precision gating and argument mapping ---------------------------------------------------

def test_npu_profiles_gate_dtypes_and_schemes(fake_npu) -> None:
    backend = npu.make_backend()
    assert backend.is_available() == (True, "1 NPU(s), torch_npu 7.0.0+fake")
    a2 = backend.device_profile(torch.device("cpu"))
    assert torch.bfloat16 in a2.dtypes and "w4a16" in a2.quant
    older = DeviceSelection(torch.device("cpu"), backend, npu.profile_for_name("Ascend310P3"), backend.adapter())
    with pytest.raises(PrecisionError, match="supported dtypes: float16, float32"):
        check_precision(older, torch.bfloat16)
    with pytest.raises(PrecisionError, match="w4a16"):
        check_precision(older, torch.float16, "w4a16")
    plugins = make_plugin_manager(load_entry_points=False)
    table = resolve_ops(older, OpRequest(torch.float16, torch.float16, "w8a16", 64, 16), plugins=plugins)
    assert table.sources["paged_attention"] == table.sources["quant_matmul"] == "npu"
    fp32 = resolve_ops(older, OpRequest(torch.float32, torch.float32, "none", 64, 16), plugins=plugins)
    assert {f.op for f in fp32.fallbacks} >= {"paged_attention"}  # the fused attention has no fp32


@pytest.mark.parametrize("op", ["rms_norm", "rotary_embedding", "paged_attention", "quant_matmul"])
def test_npu_kernels_match_the_reference_through_the_fake(fake_npu, op) -> None:
    backend = npu.make_backend()
    checked = 0
    for case in cases(op):
        for dtype in ALL:
            inputs = make_inputs(op, dtype, head_size=64, block_size=16, case=case)
            quant = case_quant(op, case)  # GGUF cases need the AFFINE_CAPABILITY caps, not just the scheme
            kernel = _kernel(backend, op, dtype, quant)
            if kernel is None or case_caps(op, case) or not _float_kv(inputs):
                continue  # not claimed (ALiBi, score caps: its caps say no, and the kernel raises, see below)
            expected = run_case(op_specs()[op].reference, op, inputs)
            assert_close(run_case(kernel, op, inputs), expected, dtype)
            checked += 1
    assert checked >= 6 and fake_npu.calls, "the kernels must go through torch_npu"


def test_npu_paged_attention_passes_block_table_and_lengths(fake_npu) -> None:
    decode = make_inputs("paged_attention", torch.float16, head_size=64, block_size=16, case="decode")
    npu_kernels.paged_attention(**decode)
    (call,) = fake_npu.named("npu_incre_flash_attention")
    assert call["actual_seq_lengths"] == decode["seq_lens"].tolist()
    assert torch.equal(call["block_table"], decode["block_tables"].int())
    assert call["key"].data_ptr() == decode["k_cache"].data_ptr()  # the cache is read in place
    assert (call["num_heads"], call["num_key_value_heads"], call["block_size"]) == (7, 1, 16)
    assert call["scale_value"] == decode["scale"] and call["key"].shape[-1] == 64
    mixed = make_inputs("paged_attention", torch.float16, head_size=64, block_size=16, case="mixed")
    npu_kernels.paged_attention(**mixed)
    (call,) = fake_npu.named("npu_fused_infer_attention_score")
    q_lens = torch.diff(mixed["cu_seqlens_q"]).tolist()
    assert call["actual_seq_lengths"] == q_lens and call["actual_seq_lengths_kv"] == mixed["seq_lens"].tolist()
    assert call["atten_mask"].shape == (4, 1, max(q_lens), mixed["block_tables"].shape[1] * 16)
    assert call["query"].shape == (4, max(q_lens), 8 * 64) and call["sparse_mode"] == 0
    with pytest.raises(NotImplementedError, match="ALiBi"):
        npu_kernels.paged_attention(**make_inputs("paged_attention", torch.float16, case="alibi"))


def test_npu_rms_norm_epsilon_and_rotary_modes(fake_npu) -> None:
    inputs = make_inputs("rms_norm", torch.bfloat16, case="residual")
    npu_kernels.rms_norm(inputs["x"], inputs["weight"], 3e-5, inputs["residual"])
    (call,) = fake_npu.named("npu_rms_norm")
    assert call["epsilon"] == 3e-5 and torch.equal(call["x"], inputs["x"] + inputs["residual"])
    for case, mode in (("neox", "half"), ("interleaved", "interleave")):
        npu_kernels.rotary_embedding(**make_inputs("rotary_embedding", torch.float16, head_size=64, case=case))
        assert {c["rotary_mode"] for c in fake_npu.named("npu_rotary_mul")[-2:]} == {mode}


def test_npu_weight_quant_layout_scales_offsets_and_cache(fake_npu) -> None:
    grouped = make_inputs("quant_matmul", torch.float16, case="w8a16_group64_tokens")
    npu_kernels.quant_matmul(**grouped)
    call = fake_npu.named("npu_weight_quant_batchmatmul")[-1]
    weight = grouped["weight"]
    assert torch.equal(call["weight"], weight.data.t()) and call["antiquant_group_size"] == 64
    assert call["antiquant_scale"].shape == (2, 48) and call["antiquant_offset"] is None
    asym = make_inputs("quant_matmul", torch.float16, case="w4a16_group64_asym_odd_n")
    npu_kernels.quant_matmul(**asym)
    npu_kernels.quant_matmul(**asym)
    assert len(fake_npu.named("npu_convert_weight_to_int4pack")) == 1  # re-layout built once per weight
    call = fake_npu.named("npu_weight_quant_batchmatmul")[-1]
    zeros = asym["weight"].zeros.t().float()
    assert torch.equal(call["antiquant_offset"][:, :33].float(), 8 - zeros) and call["weight"].shape == (64, 40 // 8)


# --- torch-native kernels (xpu, gcu), checked on CPU ----------------------------------------------

@pytest.mark.parametrize("op", list(native.NATIVE_KERNELS))
def test_native_kernels_match_the_reference_on_cpu(op) -> None:
    fn, caps = native.NATIVE_KERNELS[op]
    for case in cases(op):
        for dtype in sorted(caps.dtypes, key=str):
            inputs = make_inputs(op, dtype, head_size=64, block_size=16, case=case)
            if not _float_kv(inputs) or any(not claims(caps, flag) for flag in case_caps(op, case)):
                continue  # quantized caches, score caps and sinks are not claimed (caps.kv_dtypes are float)
            assert_close(run_case(fn, op, inputs), run_case(op_specs()[op].reference, op, inputs), dtype)


def test_xpu_is_selected_when_torch_xpu_reports_a_device(monkeypatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda device=None: types.SimpleNamespace(
        has_subgroup_matrix_multiply_accumulate=False))
    selection = select_device("xpu", plugins=make_plugin_manager(load_entry_points=False))
    assert selection.backend.name == "xpu" and selection.adapter.dist_backend == "xccl"
    assert not selection.profile.native_bf16 and selection.profile.name.startswith("Intel GPU without XMX")


def test_gcu_with_a_fake_torch_gcu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_gcu", types.ModuleType("torch_gcu"))
    monkeypatch.setattr(torch, "gcu", types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2),
                        raising=False)
    backend = gcu.make_backend()
    assert backend.is_available() == (True, "2 GCU(s)") and backend.adapter().dist_backend == "eccl"
    assert torch.bfloat16 not in backend.device_profile(torch.device("cpu")).dtypes  # not documented: not claimed


# --- dcu ------------------------------------------------------------------------------------------

def test_dcu_profiles_by_gfx_arch() -> None:
    assert torch.bfloat16 not in dcu.profile_for_arch("gfx906:sramecc+:xnack-").dtypes
    assert torch.bfloat16 in dcu.profile_for_arch("gfx928:sramecc+:xnack-").dtypes
    assert all("fp8" not in p.quant for p in dcu.make_backend().known_profiles())
    with pytest.raises(ValueError, match="gfx1100"):
        dcu.profile_for_arch("gfx1100")


def test_dcu_outranks_cuda_on_a_rocm_build(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        gcnArchName="gfx906:sramecc+:xnack-"))
    selection = select_device("cuda", plugins=make_plugin_manager(load_entry_points=False))
    assert selection.backend.name == "dcu" and torch.bfloat16 not in selection.profile.dtypes
    assert set(selection.backend.kernels) == set(make_plugin_manager().backends()["cuda"].kernels)


# --- end to end: a tiny Llama "on npu" through the fake -------------------------------------------

def test_tiny_llama_generates_the_reference_tokens_through_the_npu_fake(monkeypatch, tmp_path) -> None:
    from flashllm import LLM, SamplingParams
    from flashllm.testing.tiny_models import build_tiny_model

    # transformers probes for torch_npu when it loads: build the model before the fake exists
    model = build_tiny_model(tmp_path, "llama", seed=3, tokenizer=False, hidden_size=256)  # head_dim 64
    fake_npu = install_fake_npu(monkeypatch)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 10, 12, 13, 14, 15, 16, 17, 18], [3, 1, 4]]
    common = dict(device="cpu", dtype="float16", num_kv_blocks=16, block_size=16, max_model_len=64)
    ours = LLM(str(model), backend="npu", **common).generate(prompts, params)
    ref = LLM(str(model), backend="reference", **common).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]
    assert fake_npu.named("npu_fused_infer_attention_score") and fake_npu.named("npu_incre_flash_attention")
